"""Decode attention on the C kernel (``decode_attention.c``): the decode rows of every step.

The kernel reads each sequence's K/V where they are: the blocks of its block table (paged layout) or
its virtually contiguous slot (xTensor layout, one base address per sequence), with no gather into a
padded buffer and no mask. A sequence's step of at most ``SHORT_QUERY`` tokens (a speculative step's
drafts, a short prompt chunk) runs the kernel too, a row per token (not over an 8-bit cache, whose prompt
chunks keep the reference's attention over their own unquantized K/V). Longer prefill chunks in a step run
the torch reference (one SDPA per chunk) and the rest still run the kernel, so a decode's result does
not depend on what shares its step. float32 and bfloat16 take the kernel (q and cache of one dtype; bfloat16: K/V
widened to float32 as read, softmax and sums in float32, the output rounded once, as the reference's
float32 SDPA then cast); so does an 8-bit cache (``ops/kv_quant.py``) under float32 or bfloat16 q, its
rows widened and scaled in registers (the ``_q8`` kernels), and its new rows quantized by one C call;
other dtypes and head shapes the kernel does not take run the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ops.attention_metadata import AttentionMetadata, ContiguousKV
from ops.cpu_kernels.build import kernel_library
from ops.kv_quant import SCALE_BYTES, kv_format
from ops.torch_ref import attention as ref
from ops.torch_ref import attention_contiguous as ref_contiguous
from ops.torch_ref.kv_store import store_kv

reference_attention = ref.attention
reference_contiguous = ref_contiguous.attention_contiguous

_SCRATCH_KEY = "cpu_kernels.decode_attention"
_USABLE_KEY = "cpu_kernels.decode_attention.usable"
SHORT_QUERY = 16  # a sequence's step of at most this many tokens runs the kernel, a row per token
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _call(name: str, q: torch.Tensor, cache: torch.Tensor, q_ptr: int, out_ptr: int, *args: object) -> None:
    """Kernel ``name`` for ``q``'s dtype and the cache's: ``name`` for float32, ``name``_bf16 for
    bfloat16, ``name``_q8 (told q's dtype and the 8-bit format) for an 8-bit cache."""
    lib = kernel_library("decode_attention")
    fmt = kv_format(cache)
    if fmt is None:
        getattr(lib, name if q.dtype == torch.float32 else f"{name}_bf16")(q_ptr, out_ptr, *args)
        return
    q_bf16, fp8 = int(q.dtype == torch.bfloat16), int(fmt == "fp8")
    getattr(lib, f"{name}_q8")(q_ptr, out_ptr, q_bf16, fp8, *args)


class _Rows:
    """Which tokens of a step the kernel runs, one row each, and the per-row tensors (built once).

    A decode is one row. A sequence computing at most ``SHORT_QUERY`` tokens (a speculative step's last
    token and drafts, a short prompt chunk) is a row per token, each reading the KV up to its own
    position (the step's new K/V are stored before the kernel runs): causal attention, as the
    reference computes it, without a padded query block. Longer chunks run the reference."""

    def __init__(self, meta: AttentionMetadata, short: int = SHORT_QUERY) -> None:
        self.short = short  # the longest query the kernel takes (``_short_query``)
        starts = [0]
        for n in meta.query_lens_cpu:
            starts.append(starts[-1] + n)
        self.starts = starts
        self.all_decode = meta.is_all_decode and starts[-1] == meta.num_seqs
        if self.all_decode:
            self.decode_seqs = list(range(meta.num_seqs))  # the sequence of each row
            self.tokens = None
            self.seq_lens, self.tables = meta.seq_lens.contiguous(), meta.block_tables.contiguous()
        else:
            seqs, tokens, lens = [], [], []
            for b, n in enumerate(meta.query_lens_cpu):
                if n <= short:
                    seqs += [b] * n
                    tokens += range(starts[b], starts[b] + n)
                    end = meta.seq_lens_cpu[b]
                    lens += range(end - n + 1, end + 1)
            self.decode_seqs = seqs
            index = torch.tensor(seqs, dtype=torch.long)
            # every token a row, in order: no gather, no scatter
            self.tokens = None if len(tokens) == starts[-1] else torch.tensor(tokens, dtype=torch.long)
            self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=meta.seq_lens.device)
            self.tables = meta.block_tables[index].contiguous()
        self.slot_index: tuple[torch.Tensor, torch.Tensor] | None = None  # xTensor (chunk, offset) per decode


def _short_query(cache: torch.Tensor) -> int:
    """The longest query per sequence the kernel takes over ``cache``: ``SHORT_QUERY``; 1 for an 8-bit
    cache, whose prompt chunks keep the reference (it attends over the chunk's own unquantized K/V)."""
    return SHORT_QUERY if kv_format(cache) is None else 1


def _rows(meta: AttentionMetadata, cache: torch.Tensor) -> _Rows:
    short = _short_query(cache)
    rows = meta.scratch.get((_SCRATCH_KEY, short))
    if rows is None:
        rows = meta.scratch[(_SCRATCH_KEY, short)] = _Rows(meta, short)
    return rows


def _usable(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether the kernel takes this step's decodes (the same answer for every layer of one shape)."""
    known = meta.scratch.setdefault(_USABLE_KEY, {})
    key = (q.dtype, cache.dtype, q.device.type, *q.shape[1:], cache.shape[-2], cache.shape[-1])
    if key not in known:
        known[key] = _check_usable(q, cache, meta)
    return known[key]


def _check_usable(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    quantized = kv_format(cache) is not None
    if q.dtype not in _KERNEL_DTYPES or not (quantized or cache.dtype == q.dtype) or q.device.type != "cpu":
        return False
    if q.dim() == 3 and cache.shape[-1] != q.shape[-1] + (SCALE_BYTES if quantized else 0):
        return False
    if meta.seq_lens.dtype != torch.int32 or meta.block_tables.dtype != torch.int32 or q.dim() != 3:
        return False  # the kernel reads int32 lengths and tables
    if not any(n <= _short_query(cache) for n in meta.query_lens_cpu):
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
    _store_kv(k, v, kv_cache, meta.slot_mapping)
    rows = _rows(meta, kv_cache)
    _, _, block_size, num_kv_heads, width = kv_cache.shape  # width: head_dim (+ the scale when 8-bit)
    head_dim = q.shape[-1]
    k_base = kv_cache.data_ptr()  # K and V planes (no per-call views)
    v_base = k_base + kv_cache.stride(0) * kv_cache.element_size()

    def kernel(qd: torch.Tensor, res: torch.Tensor) -> None:
        _call(
            "xllm_decode_attention_paged", qd, kv_cache, qd.data_ptr(), res.data_ptr(), qd.shape[0],
            qd.shape[1], num_kv_heads, head_dim, k_base, v_base, block_size * num_kv_heads * width,
            num_kv_heads * width, block_size, rows.tables.data_ptr(), rows.tables.shape[1],
            rows.seq_lens.data_ptr(), sliding_window or 0, scale, torch.get_num_threads(),
        )  # fmt: skip

    def prefill(b: int, s: int, e: int) -> torch.Tensor:
        return ref._prefill(q[s:e], k[s:e], v[s:e], kv_cache, meta, b, scale, sliding_window)

    return _decodes_and_prefills(q, meta, rows, kernel, prefill)


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
    assert meta.kv_slots is not None, "the xTensor layout sets meta.kv_slots"
    _store_kv(k, v, kv.paged, meta.slot_mapping)
    rows = _rows(meta, kv.paged)
    chunk, offset = _slot_index(kv, meta, rows)
    k_chunks = torch.tensor([c.data_ptr() for c in kv.k_chunks], dtype=torch.int64)
    v_chunks = torch.tensor([c.data_ptr() for c in kv.v_chunks], dtype=torch.int64)
    num_kv_heads, head_dim = view.shape[2], q.shape[-1]
    slots = meta.kv_slots

    def kernel(qd: torch.Tensor, res: torch.Tensor) -> None:
        _call(
            "xllm_decode_attention_slots", qd, kv.paged, qd.data_ptr(), res.data_ptr(), qd.shape[0],
            qd.shape[1], num_kv_heads, head_dim, k_chunks.data_ptr(), v_chunks.data_ptr(),
            chunk.data_ptr(), offset.data_ptr(), view.stride(1), rows.seq_lens.data_ptr(),
            sliding_window or 0, scale, torch.get_num_threads(),
        )  # fmt: skip

    def prefill(b: int, s: int, e: int) -> torch.Tensor:
        seq_len = meta.seq_lens_cpu[b]
        return ref_contiguous._prefill(q[s:e], k[s:e], v[s:e], kv, slots[b], seq_len, scale, sliding_window)

    return _decodes_and_prefills(q, meta, rows, kernel, prefill)


def _store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``store_kv`` with one C call (``xllm_store_kv``) where the rows are float32 or bfloat16
    ``[T, Hkv, D]`` (the cache's dtype) with contiguous heads and the cache ``[2, ..., Hkv, D]`` is
    contiguous; an 8-bit cache's rows are quantized on the way (``_store_kv_q8``)."""
    if kv_format(kv_cache) is not None:
        return _store_kv_q8(k, v, kv_cache, slot_mapping)
    row = kv_cache.shape[-2] * kv_cache.shape[-1]
    if not (
        k.dtype == v.dtype == kv_cache.dtype
        and kv_cache.dtype in _KERNEL_DTYPES
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.numel() == k.shape[0] == v.shape[0]
        and kv_cache.is_contiguous()
        and k.shape[1:] == v.shape[1:] == kv_cache.shape[-2:]
        and k.stride()[1:] == v.stride()[1:] == (kv_cache.shape[-1], 1)
    ):
        return store_kv(k, v, kv_cache, slot_mapping)
    kernel_library("decode_attention").xllm_store_kv(
        k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kv_cache.data_ptr(),
        kv_cache.data_ptr() + kv_cache.stride(0) * kv_cache.element_size(), slot_mapping.data_ptr(),
        slot_mapping.numel(), row, kv_cache.element_size(),
    )  # fmt: skip


def _store_kv_q8(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``store_kv`` into an 8-bit cache with one C call (``xllm_store_kv_q8``, the reference's bytes)
    where the rows are float32 or bfloat16 ``[T, Hkv, D]`` with contiguous heads and D a multiple of 16."""
    num_kv_heads, width = kv_cache.shape[-2:]
    head_dim = width - SCALE_BYTES
    if not (
        k.dtype == v.dtype
        and k.dtype in _KERNEL_DTYPES
        and head_dim % 16 == 0
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.numel() == k.shape[0] == v.shape[0]
        and kv_cache.is_contiguous()
        and k.shape[1:] == v.shape[1:] == (num_kv_heads, head_dim)
        and k.stride()[1:] == v.stride()[1:] == (head_dim, 1)
    ):
        return store_kv(k, v, kv_cache, slot_mapping)
    kernel_library("decode_attention").xllm_store_kv_q8(
        k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kv_cache.data_ptr(),
        kv_cache.data_ptr() + kv_cache.stride(0), slot_mapping.data_ptr(), slot_mapping.numel(),
        num_kv_heads, head_dim, int(k.dtype == torch.bfloat16), int(kv_format(kv_cache) == "fp8"),
        torch.get_num_threads(),
    )  # fmt: skip


def _decodes_and_prefills(
    q: torch.Tensor,
    meta: AttentionMetadata,
    rows: _Rows,
    kernel: Callable[[torch.Tensor, torch.Tensor], None],
    prefill: Callable[[int, int, int], torch.Tensor],
) -> torch.Tensor:
    """The decode rows through ``kernel(q rows, out rows)``, each prefill chunk ``b`` (tokens
    ``s:e``) through ``prefill(b, s, e)``."""
    qd = q.contiguous() if rows.tokens is None else q[rows.tokens]
    res = torch.empty_like(qd)
    kernel(qd, res)
    if rows.tokens is None:
        return res
    out = torch.empty_like(q)
    out[rows.tokens] = res
    for b, q_len in enumerate(meta.query_lens_cpu):
        if q_len > rows.short:
            out[rows.starts[b] : rows.starts[b + 1]] = prefill(b, rows.starts[b], rows.starts[b + 1])
    return out


def _slot_index(kv: ContiguousKV, meta: AttentionMetadata, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Which chunk each decode's slot is in and its byte offset there (int64): the same in every
    layer, so built once per step; the kernel adds the layer's chunk base."""
    assert meta.kv_slots is not None
    if rows.slot_index is None:
        per_chunk, row_bytes = kv.slots_per_chunk, kv.k_chunks[0].stride(0) * kv.k_chunks[0].element_size()
        slots = [meta.kv_slots[b] for b in rows.decode_seqs]
        rows.slot_index = (
            torch.tensor([s // per_chunk for s in slots], dtype=torch.int64),
            torch.tensor([s % per_chunk * row_bytes for s in slots], dtype=torch.int64),
        )
    return rows.slot_index
