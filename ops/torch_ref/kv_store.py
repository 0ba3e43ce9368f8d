"""Reference KV store: scatter new K/V rows into the flat slot view of the paged cache.

An 8-bit cache (``ops/kv_quant.py``) gets each row quantized with its own scale on the way in.
"""

from __future__ import annotations

import torch

from ops.kv_quant import kv_format, quantize


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, width)
    fmt = kv_format(kv_cache)
    if fmt is not None:
        k, v = quantize(k, fmt), quantize(v, fmt)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
