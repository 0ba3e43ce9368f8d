"""Paged decode attention for full device graphs, in two Triton kernels.

``attention_static`` is ``ops/torch_ref/attention_static.py`` without a host read or a data-dependent
shape: the K/V store skips padding rows (slot -1) by a mask, and the attention kernel loops over each
sequence's context up to the length it loads from ``seq_lens``, reading blocks through the block
table (online softmax over tiles of ``BLOCK_N`` tokens, one program per sequence and KV head, the
KV head's query rows together). Launch shapes depend only on the bucket, so a CUDA graph captured
once replays on any step's metadata copied into the same buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.attention_metadata import AttentionMetadata

BLOCK_N = 32  # context tokens per tile


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slots, k_stride, v_stride, ROW: tl.constexpr, ROW_P: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    offs = tl.arange(0, ROW_P)
    mask = (offs < ROW) & ((offs * 0 + slot) >= 0)  # the slot test as a block, like the bound
    k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
    tl.store(k_cache + slot * ROW + offs, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + slot * ROW + offs, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, out_ptr, k_cache, v_cache, tables, lens, scale, window,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, table_stride, block_size,
    NUM_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, DIM: tl.constexpr,
    DIM_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, DIM_P)
    n = tl.arange(0, BLOCK)
    rows = h * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < DIM)[None, :]
    q = tl.load(q_ptr + b * q_stride_t + rows[:, None] * q_stride_h + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)
    length = tl.load(lens + b)
    start = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
    for s in range(start, length, BLOCK):
        pos = s + n
        valid = pos < length
        blk = tl.load(tables + b * table_stride + pos // block_size, mask=valid, other=0).to(tl.int64)
        offs = (blk * block_size + pos % block_size)[:, None] * (NUM_KV * DIM) + h * DIM + d[None, :]
        kv_mask = valid[:, None] & (d < DIM)[None, :]
        k = tl.load(k_cache + offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK, DIM_P]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P, BLOCK]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache + offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    denom = tl.where(denom > 0, denom, 1.0)  # a padding row (no context) comes out as zeros
    out = acc / denom[:, None]
    o_ptrs = out_ptr + b * o_stride_t + rows[:, None] * o_stride_h + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def store_kv_static(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k``/``v`` rows ([T, Hkv, D]) into the paged cache at their slots; rows with slot < 0 skipped."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = num_kv_heads * head_dim
    _store_kv_kernel[(k.shape[0],)](
        k, v, kv_cache[0], kv_cache[1], slot_mapping, k.stride(0), v.stride(0), ROW=row,
        ROW_P=triton.next_power_of_2(row),
    )  # fmt: skip


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
    if not isinstance(kv_cache, torch.Tensor) or not kv_cache.is_contiguous():
        raise TypeError("full device graphs run on a contiguous paged KV cache")
    store_kv_static(k, v, kv_cache, meta.slot_mapping)
    q = q if q.stride(2) == 1 else q.contiguous()
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tables = meta.block_tables
    _decode_kernel[(batch, num_kv_heads)](
        q, out, kv_cache[0], kv_cache[1], tables, meta.seq_lens, float(scale), int(sliding_window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), block_size,
        NUM_KV=num_kv_heads, GROUP=group, GROUP_P=triton.next_power_of_2(group), DIM=head_dim,
        DIM_P=triton.next_power_of_2(head_dim), BLOCK=BLOCK_N,
    )  # fmt: skip
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] with each row's H * D values contiguous (a projection's slice already is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
