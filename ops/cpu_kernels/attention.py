"""Decode attention on the C kernel (``decode_attention.c``): every step whose tokens are all decodes.

The kernel reads each sequence's K/V where they are: the blocks of its block table (paged layout) or
its virtually contiguous slot (xTensor layout, one base address per sequence), with no gather into a
padded buffer and no mask. Steps with prefill chunks, other dtypes or head shapes the kernel does not
take run the torch reference (``ops/torch_ref``).
"""

from __future__ import annotations

import torch

from ops.attention_metadata import AttentionMetadata, ContiguousKV
from ops.cpu_kernels.build import kernel_library
from ops.torch_ref.attention import attention as reference_attention
from ops.torch_ref.attention_contiguous import attention_contiguous as reference_contiguous
from ops.torch_ref.kv_store import store_kv

_SCRATCH_KEY = "cpu_kernels.decode_attention"


def _usable(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    if not meta.is_all_decode or q.shape[0] != meta.num_seqs or q.shape[0] == 0:
        return False
    if q.dtype != torch.float32 or cache.dtype != torch.float32 or q.device.type != "cpu":
        return False
    lib = kernel_library("decode_attention")
    _, num_heads, head_dim = q.shape
    return lib is not None and bool(lib.xllm_decode_attention_supported(num_heads, cache.shape[-2], head_dim))


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``ops.attention.attention`` over the paged cache ``[2, blocks, block_size, Hkv, D]``."""
    if not _usable(q, kv_cache, meta) or not kv_cache.is_contiguous():
        return reference_attention(q, k, v, kv_cache, meta, scale, sliding_window)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = meta.block_tables if meta.block_tables.is_contiguous() else meta.block_tables.contiguous()
    kernel_library("decode_attention").xllm_decode_attention_paged(
        q.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], num_kv_heads, head_dim,
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_size * num_kv_heads * head_dim,
        num_kv_heads * head_dim, block_size, tables.data_ptr(), tables.shape[1], meta.seq_lens.data_ptr(),
        sliding_window or 0, scale, torch.get_num_threads(),
    )  # fmt: skip
    return out


def decode_attention_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: ContiguousKV,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``ops.attention.attention`` over the xTensor layout: each sequence's slot read in place."""
    view = kv.k_chunks[0] if kv.k_chunks else None
    if (
        view is None
        or not _usable(q, kv.paged, meta)
        or view.stride(3) != 1
        or view.stride(2) != view.shape[3]
        or kv.v_chunks[0].stride() != view.stride()
    ):
        return reference_contiguous(q, k, v, kv, meta, scale, sliding_window)
    store_kv(k, v, kv.paged, meta.slot_mapping)
    k_bases, v_bases = _slot_bases(kv, meta)
    _, _, num_kv_heads, head_dim = view.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    kernel_library("decode_attention").xllm_decode_attention_slots(
        q.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], num_kv_heads, head_dim, k_bases.data_ptr(),
        v_bases.data_ptr(), view.stride(1), meta.seq_lens.data_ptr(), sliding_window or 0, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _slot_bases(kv: ContiguousKV, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 addresses of token 0 of each sequence's slot, K and V, for this layer's chunks."""
    assert meta.kv_slots is not None, "the xTensor layout sets meta.kv_slots"
    per_chunk = kv.slots_per_chunk
    index = meta.scratch.get(_SCRATCH_KEY)
    if index is None:  # which chunk and row each sequence's slot is: the same in every layer
        chunks = torch.tensor([s // per_chunk for s in meta.kv_slots], dtype=torch.int64)
        rows = torch.tensor([s % per_chunk for s in meta.kv_slots], dtype=torch.int64)
        index = meta.scratch[_SCRATCH_KEY] = (chunks, rows)
    chunks, rows = index
    row_bytes = kv.k_chunks[0].stride(0) * kv.k_chunks[0].element_size()
    k_base = torch.tensor([c.data_ptr() for c in kv.k_chunks], dtype=torch.int64)
    v_base = torch.tensor([c.data_ptr() for c in kv.v_chunks], dtype=torch.int64)
    offsets = rows * row_bytes
    return k_base[chunks] + offsets, v_base[chunks] + offsets
