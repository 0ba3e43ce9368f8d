"""KV-store facade: write new keys/values into the paged KV cache."""

from __future__ import annotations

import torch

from ops.registry import get_op


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ([T, Hkv, D]) into ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) at the
    flat slots ``slot_mapping`` ([T] int64; every slot must be valid, i.e. >= 0). In place. An 8-bit
    cache (``[..., D + 4]`` int8 / uint8, ``ops/kv_quant.py``) stores each row quantized with its scale."""
    get_op("store_kv")(k, v, kv_cache, slot_mapping)
