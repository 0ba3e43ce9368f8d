"""Reference paged attention over a mixed prefill/decode batch.

Decodes (query_len == 1) are batched: their context is gathered from the block tables into one padded
``[B, L, Hkv, D]`` tensor and attended with a single SDPA call under a length (and window) mask.
Prefill chunks run one SDPA call per sequence with a causal mask offset by the cached context. Scores
and softmax are computed in float32 whatever the cache dtype.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ops.attention import AttentionMetadata
from ops.torch_ref.kv_store import store_kv


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    store_kv(k, v, kv_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
    decodes = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    if decodes:
        _decode(q, out, kv_cache, meta, decodes, starts, scale, sliding_window)
    for b, q_len in enumerate(meta.query_lens_cpu):
        if q_len > 1:
            s, e = starts[b], starts[b + 1]
            out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], kv_cache, meta, b, scale, sliding_window)
    return out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (any dtype) -> float32 [B, Hq, Lq, D]."""
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )


def _gather_context(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions ``0 .. length - 1`` of each sequence: two ``[B, length, Hkv, D]`` tensors.

    Positions at or past a sequence's ``seq_lens`` read its position 0 instead, so padding never picks
    up unwritten (possibly NaN) cache memory; callers mask those positions out.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    pos = torch.arange(length, device=kv_cache.device)
    pos = torch.where(pos < seq_lens.unsqueeze(1), pos, 0)  # [B, length]
    slots = block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    shape = (*slots.shape, num_kv_heads, head_dim)
    index = slots.flatten()
    return flat[0].index_select(0, index).view(shape), flat[1].index_select(0, index).view(shape)


def _decode(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    decodes: list[int],
    starts: list[int],
    scale: float,
    sliding_window: int | None,
) -> None:
    all_decode = len(decodes) == meta.num_seqs
    device = q.device
    seq_idx = None if all_decode else torch.tensor(decodes, device=device)
    tok_idx = None if all_decode else torch.tensor([starts[b] for b in decodes], device=device)
    max_len = max(meta.seq_lens_cpu[b] for b in decodes)
    tables = meta.block_tables if seq_idx is None else meta.block_tables[seq_idx]
    seq_lens = meta.seq_lens if seq_idx is None else meta.seq_lens[seq_idx]
    key_pos = torch.arange(max_len, device=device)
    last = (seq_lens.long() - 1).unsqueeze(1)  # position of each query token
    mask = key_pos <= last
    if sliding_window is not None:
        mask &= key_pos > last - sliding_window
    k_ctx, v_ctx = _gather_context(kv_cache, tables, seq_lens, max_len)  # [B, L, Hkv, D]
    q_dec = q if tok_idx is None else q[tok_idx]  # [B, Hq, D]
    res = _sdpa(
        q_dec.unsqueeze(2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), mask[:, None, None, :], scale, False
    )
    res = res.squeeze(2).to(out.dtype)
    if tok_idx is None:
        out.copy_(res)
    else:
        out[tok_idx] = res


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    b: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention of one sequence's ``q_len`` new tokens ([q_len, H, D]) over its context."""
    q_len, seq_len = q.shape[0], meta.seq_lens_cpu[b]
    first = seq_len - q_len  # position of the first new token
    qh = q.transpose(0, 1).unsqueeze(0)
    if first == 0 and (sliding_window is None or sliding_window >= q_len):
        # No cached context and no effective window: the new K/V are the whole context.
        res = _sdpa(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), None, scale, True)
        return res[0].transpose(0, 1).to(q.dtype)
    # Keys before this start are outside every new token's window.
    start = 0 if sliding_window is None else max(0, first - sliding_window + 1)
    k_ctx, v_ctx = _gather_context(kv_cache, meta.block_tables[b : b + 1], meta.seq_lens[b : b + 1], seq_len)
    k_ctx, v_ctx = k_ctx[0, start:].transpose(0, 1), v_ctx[0, start:].transpose(0, 1)  # [Hkv, L, D]
    key_pos = torch.arange(start, seq_len, device=q.device)
    q_pos = torch.arange(first, seq_len, device=q.device).unsqueeze(1)
    mask = key_pos <= q_pos
    if sliding_window is not None:
        mask &= key_pos > q_pos - sliding_window
    res = _sdpa(qh, k_ctx.unsqueeze(0), v_ctx.unsqueeze(0), mask, scale, False)
    return res[0].transpose(0, 1).to(q.dtype)
