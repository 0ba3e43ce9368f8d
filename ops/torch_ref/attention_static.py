"""Decode attention of a full device graph's step, from device tensors only (the reference).

``meta.static`` metadata (``graph/full.py``): row ``b`` is one decode token of a sequence whose
context after this step is ``seq_lens[b]`` tokens in the blocks of ``block_tables[b]``; its K/V go to
``slot_mapping[b]``. Rows with ``seq_lens`` 0 and slot -1 are bucket padding. Nothing here reads the
host fields (they describe the capture, not the step), which is what lets a captured graph replay
this work on new metadata. The CUDA backend (``ops/triton_kernels/decode_attention.py``) does the same in two
Triton kernels; this is their oracle and what the CPU runs. An 8-bit cache (``ops/kv_quant.py``) is
dequantized to float32 as its blocks are gathered (the Triton kernels take 16/32-bit caches only).
"""

from __future__ import annotations

import torch

from ops.attention_mask import visible_keys
from ops.attention_metadata import AttentionMetadata
from ops.kv_quant import dequantize, kv_format
from ops.torch_ref.kv_store import store_kv


def store_kv_static(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k``/``v`` rows ([T, Hkv, D]) into the paged cache at their slots; rows with slot < 0 skipped."""
    keep = slot_mapping >= 0
    store_kv(k[keep], v[keep], kv_cache, slot_mapping[keep])


def attention_static(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``ops.attention.attention`` for ``meta.static``: q [B, Hq, D] (one token per row) -> [B, Hq, D]."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError("full device graphs run on the paged KV layout")
    store_kv_static(k, v, kv_cache, meta.slot_mapping)
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, row = kv_cache.shape
    tables = meta.block_tables.long()  # [B, W]
    width = tables.shape[1]
    keys = kv_cache[0][tables].reshape(batch, width * block_size, num_kv_heads, row)
    values = kv_cache[1][tables].reshape(batch, width * block_size, num_kv_heads, row)
    if kv_format(kv_cache) is not None:
        keys, values = dequantize(keys), dequantize(values)
    pos = torch.arange(width * block_size, device=q.device)
    last = meta.seq_lens.long()[:, None] - 1  # each row's query position (-1: a padding row sees nothing)
    valid = visible_keys(pos[None, :], last, sliding_window or None)  # [B, L]
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a padding row (no context) attends nothing
    out = torch.einsum("bhgl,blhd->bhgd", probs, values.float())
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
