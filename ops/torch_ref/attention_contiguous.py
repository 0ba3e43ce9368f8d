"""Reference attention over xTensor KV: each sequence's context read in place, no block-table gather.

New K/V rows are written through the paged view (``meta.slot_mapping``); the same bytes appear in
each sequence's virtually contiguous slot (``ContiguousKV``). Decodes are sorted by slot and cut into
runs of consecutive slots inside one chunk: each run is one strided ``[r, max_len, Hkv, D]`` view that
SDPA reads directly, under a length (and window) mask. Prefill chunks attend over
``slot[:seq_len]`` of their own slot. Scores and softmax in float32 whatever the cache dtype (with
attention sinks, as ``ops/torch_ref/attention.py`` computes them); an 8-bit
cache's context is dequantized to float32 as read, and fresh prompts attend over their K/V as stored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ops.attention_mask import context_start, decode_mask, is_fresh_prefill, prefill_mask
from ops.attention_metadata import AttentionMetadata, ContiguousKV
from ops.kv_quant import dequantize, kv_format, roundtrip
from ops.torch_ref.attention import _sdpa, head_sinks
from ops.torch_ref.kv_store import store_kv

_SCRATCH_KEY = "torch_ref.attention_contiguous"


@dataclass
class _Run:
    """Decodes whose slots are consecutive in one chunk."""

    chunk: int
    first_row: int  # row of the first slot in its chunk
    rows: torch.Tensor  # token rows of these decodes in the batch, in slot order
    max_len: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # [r, 1, 1, max_len] by window
    last: torch.Tensor | None = None  # [r, 1] position of each decode's query


@dataclass
class _Step:
    starts: list[int]
    runs: list[_Run]
    num_decodes: int
    one_run_in_order: bool  # all tokens are decodes in one run, in batch order: no scatter needed


def attention_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: ContiguousKV,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    store_kv(k, v, kv.paged, meta.slot_mapping)
    step = _step(meta, kv.slots_per_chunk, q.device)
    if step.one_run_in_order:
        return _decode_run(q, kv, step.runs[0], scale, sliding_window, sinks).to(q.dtype)
    out = q.new_empty(q.shape)
    for run in step.runs:
        out[run.rows] = _decode_run(q, kv, run, scale, sliding_window, sinks).to(out.dtype)
    assert meta.kv_slots is not None
    for b, q_len in enumerate(meta.query_lens_cpu):
        if q_len > 1:
            s, e = step.starts[b], step.starts[b + 1]
            slot, seq_len = meta.kv_slots[b], meta.seq_lens_cpu[b]
            out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], kv, slot, seq_len, scale, sliding_window, sinks)
    return out


def _step(meta: AttentionMetadata, per_chunk: int, device: torch.device) -> _Step:
    step = meta.scratch.get(_SCRATCH_KEY)
    if step is not None:
        return step
    assert meta.kv_slots is not None, "the xTensor layout sets meta.kv_slots"
    starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
    decodes = sorted(
        (meta.kv_slots[b], starts[b], meta.seq_lens_cpu[b])
        for b, n in enumerate(meta.query_lens_cpu)
        if n == 1
    )
    runs: list[_Run] = []
    group: list[tuple[int, int, int]] = []
    for item in decodes:
        if group and (item[0] != group[-1][0] + 1 or item[0] // per_chunk != group[0][0] // per_chunk):
            runs.append(_make_run(group, per_chunk, device))
            group = []
        group.append(item)
    if group:
        runs.append(_make_run(group, per_chunk, device))
    in_order = [t for _, t, _ in decodes] == list(range(meta.num_seqs)) and len(decodes) == starts[-1]
    step = meta.scratch[_SCRATCH_KEY] = _Step(starts, runs, len(decodes), len(runs) == 1 and in_order)
    return step


def _make_run(group: list[tuple[int, int, int]], per_chunk: int, device: torch.device) -> _Run:
    slot0 = group[0][0]
    lens = [n for _, _, n in group]
    run = _Run(
        chunk=slot0 // per_chunk,
        first_row=slot0 % per_chunk,
        rows=torch.tensor([t for _, t, _ in group], device=device),
        max_len=max(lens),
    )
    run.last = (torch.tensor(lens, device=device) - 1).unsqueeze(1)
    return run


def _decode_run(
    q: torch.Tensor,
    kv: ContiguousKV,
    run: _Run,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one run's decodes (float32 ``[r, Hq, D]``), reading their slots in place."""
    r = run.rows.numel()
    num_heads, head_dim = q.shape[1:]
    lo, hi = run.first_row, run.first_row + r
    k_ctx = _read(kv, kv.k_chunks[run.chunk][lo:hi, : run.max_len]).transpose(1, 2)  # [r, Hkv, L, D]
    v_ctx = _read(kv, kv.v_chunks[run.chunk][lo:hi, : run.max_len]).transpose(1, 2)
    num_kv_heads = k_ctx.shape[1]
    # The query heads sharing a KV head become that head's query rows: one pass over its K/V serves them.
    qg = q[run.rows].reshape(r, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = decode_mask(run.masks, run.last, run.max_len, sliding_window, q.device)
    res = _sdpa(qg, k_ctx, v_ctx, mask, scale, False, head_sinks(sinks, num_kv_heads))
    return res.reshape(r, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: ContiguousKV,
    slot: int,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence's ``q_len`` new tokens over its contiguous context."""
    q_len = q.shape[0]
    first = seq_len - q_len
    qh = q.transpose(0, 1).unsqueeze(0)
    if is_fresh_prefill(first, q_len, sliding_window):
        fmt = kv_format(kv.paged)
        k, v = roundtrip(k, fmt), roundtrip(v, fmt)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        res = _sdpa(qh, k, v, None, scale, True, head_sinks(sinks))
        return res[0].transpose(0, 1).to(q.dtype)
    start = context_start(first, sliding_window)
    chunk, row = divmod(slot, kv.slots_per_chunk)
    k_ctx = _read(kv, kv.k_chunks[chunk][row, start:seq_len]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    v_ctx = _read(kv, kv.v_chunks[chunk][row, start:seq_len]).transpose(0, 1).unsqueeze(0)
    mask = prefill_mask(first, seq_len, start, sliding_window, q.device)
    res = _sdpa(qh, k_ctx, v_ctx, mask, scale, False, head_sinks(sinks))
    return res[0].transpose(0, 1).to(q.dtype)


def _read(kv: ContiguousKV, rows: torch.Tensor) -> torch.Tensor:
    """A view of a slot's rows as SDPA reads them: the view itself, or float32 from an 8-bit cache."""
    return rows if kv_format(kv.paged) is None else dequantize(rows)
