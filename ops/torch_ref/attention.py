"""Reference paged attention over a mixed prefill/decode batch.

Decodes (query_len == 1) are batched: their context is gathered from the block tables into a padded
``[B, L, Hkv, D]`` buffer and attended by SDPA under a length (and window) mask, a few sequences per
call so the gathered K/V are still in cache when SDPA reads them; the query heads of a KV head ride
as its query rows, so each K/V row is read once. The gather index, the masks and the buffer depend
only on the step: the first layer builds them into ``meta.scratch`` and the others reuse them.
Prefill chunks run one SDPA call per sequence with a causal mask offset by the cached context.
Scores and softmax are computed in float32 whatever the cache dtype. Attention sinks (``sinks``: one
learned logit per query head in each softmax's denominator, ``ops/attention.py``) make every SDPA call
an explicit softmax over the scores and the sink (``_sdpa``). An 8-bit cache
(``ops/kv_quant.py``) is dequantized to float32 as it is gathered, and a fresh prompt attends over its
K/V as the cache holds them (quantized and back), so a prefix-cache hit computes what a miss does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ops.attention_mask import context_start, decode_mask, is_fresh_prefill, prefill_mask
from ops.attention_metadata import AttentionMetadata
from ops.kv_quant import dequantize, kv_format, roundtrip
from ops.torch_ref.kv_store import store_kv

_SCRATCH_KEY = "torch_ref.attention"
# Gathered decode K/V per SDPA call: about a core's L2, so SDPA reads what the gather just wrote from
# cache rather than memory (15% faster at 32 x 160 tokens than one call over the whole batch).
_CHUNK_BYTES = 2 << 20


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    store_kv(k, v, kv_cache, meta.slot_mapping)
    step = _step(meta, kv_cache)
    if step.num_decodes and step.num_decodes == meta.num_seqs:
        return _decode(q, kv_cache, step, scale, sliding_window, sinks).to(q.dtype)
    out = torch.empty_like(q)
    if step.num_decodes:
        decodes = _decode(q[step.decode_tokens], kv_cache, step, scale, sliding_window, sinks)
        out[step.decode_tokens] = decodes.to(out.dtype)
    for b0, b1 in _prefill_runs(meta, sliding_window):
        s, e = step.starts[b0], step.starts[b1]
        if b1 - b0 > 1:
            fmt = kv_format(kv_cache)
            k_run, v_run = roundtrip(k[s:e], fmt), roundtrip(v[s:e], fmt)
            out[s:e] = _fresh_prefills(q[s:e], k_run, v_run, b1 - b0, scale, sinks)
        else:
            out[s:e] = _prefill(q[s:e], k[s:e], v[s:e], kv_cache, meta, b0, scale, sliding_window, sinks)
    return out


def _prefill_runs(meta: AttentionMetadata, sliding_window: int | None) -> list[tuple[int, int]]:
    """The prefill chunks as runs ``[b0, b1)`` of sequences: consecutive whole prompts of one length
    with no cached context and no effective window share a run (one SDPA call for all of them, the
    same result as one call each, and cheaper for many short prompts); any other chunk is a run
    of its own."""
    runs: list[tuple[int, int]] = []
    fresh_len = 0  # query length of the open run of fresh prompts (0: none open)
    for b, q_len in enumerate(meta.query_lens_cpu):
        if q_len <= 1:
            fresh_len = 0
            continue
        fresh = is_fresh_prefill(meta.seq_lens_cpu[b] - q_len, q_len, sliding_window)
        if fresh and q_len == fresh_len:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
        fresh_len = q_len if fresh else 0
    return runs


def _fresh_prefills(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num: int, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Causal attention of ``num`` whole prompts of one length, back to back in ``q``/``k``/``v``
    ([num * L, H, D]), each over its own tokens only: one batched SDPA call."""
    length = q.shape[0] // num
    qh, kh, vh = (t.view(num, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    res = _sdpa(qh, kh, vh, None, scale, True, head_sinks(sinks))  # [num, H, L, D]
    return res.transpose(1, 2).reshape(q.shape).to(q.dtype)


def head_sinks(sinks: torch.Tensor | None, num_kv_heads: int | None = None) -> torch.Tensor | None:
    """Per-query-head sinks ([Hq]) shaped for ``_sdpa``'s scores: ``[1, Hq, 1, 1]`` when the query heads
    are SDPA's heads, ``[1, Hkv, Hq / Hkv, 1]`` when (decodes) a KV head's query heads ride as its rows."""
    if sinks is None:
        return None
    if num_kv_heads is None:
        return sinks.float().view(1, -1, 1, 1)
    return sinks.float().view(1, num_kv_heads, -1, 1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (any dtype) -> float32 [B, Hq, Lq, D]. ``sinks``
    (``head_sinks``): each score row's softmax also counts ``exp(sink)`` (see ``_attend_with_sinks``)."""
    if sinks is not None:
        return _attend_with_sinks(q.float(), k.float(), v.float(), mask, scale, causal, sinks)
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )


def _attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Float32 attention whose softmax runs over each row's scores and its head's sink logit, the sink's
    share then dropped (it attends to nothing): ``p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink))``, HF's
    eager attention with ``s_aux`` (gpt-oss, MiMo-V2-Flash). ``mask``: boolean (True: visible) or
    additive, as SDPA takes it; ``causal``: SDPA's top-left causal mask."""
    if k.shape[1] != q.shape[1]:  # grouped query heads: head h reads KV head h // group, as SDPA's GQA
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    logits = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def _context_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, length: int, block_size: int
) -> torch.Tensor:
    """Flat cache slot of positions ``0 .. length - 1`` of each sequence: ``[B, length]`` int64.

    Positions at or past a sequence's ``seq_lens`` read its position 0 instead, so padding never picks
    up unwritten (possibly NaN) cache memory; callers mask those positions out.
    """
    pos = torch.arange(length, device=block_tables.device)
    pos = torch.where(pos < seq_lens.unsqueeze(1), pos, 0)
    return block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size


def _gather_context(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions ``0 .. length - 1`` of each sequence: two ``[B, length, Hkv, D]`` tensors
    (float32 from an 8-bit cache)."""
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    slots = _context_slots(block_tables, seq_lens, length, block_size)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, width)
    shape = (*slots.shape, num_kv_heads, width)
    index = slots.flatten()
    k, v = flat[0].index_select(0, index).view(shape), flat[1].index_select(0, index).view(shape)
    if kv_format(kv_cache) is not None:
        return dequantize(k), dequantize(v)
    return k, v


@dataclass
class _Step:
    """What the attention of every layer shares within one step."""

    starts: list[int]  # token offset of each sequence
    num_decodes: int
    decode_tokens: torch.Tensor | None = None  # token rows of the decodes (None when there are none)
    slots: torch.Tensor | None = None  # [num_decodes, max_len] flat cache slots of the decodes' context
    last: torch.Tensor | None = None  # [num_decodes, 1] position of each decode's query token
    max_len: int = 0
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by sliding window
    buffer: torch.Tensor | None = None  # [2, chunk * max_len, Hkv, width] gathered K/V, reused by every layer


def _step(meta: AttentionMetadata, kv_cache: torch.Tensor) -> _Step:
    step = meta.scratch.get(_SCRATCH_KEY)
    if step is not None:
        return step
    starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
    decodes = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    step = _Step(starts, len(decodes))
    if decodes:
        device = kv_cache.device
        if len(decodes) == meta.num_seqs:
            tables, seq_lens = meta.block_tables, meta.seq_lens
        else:
            rows = torch.tensor(decodes, device=device)
            tables, seq_lens = meta.block_tables[rows], meta.seq_lens[rows]
        step.decode_tokens = torch.tensor([starts[b] for b in decodes], device=device)
        step.max_len = max(meta.seq_lens_cpu[b] for b in decodes)
        step.slots = _context_slots(tables, seq_lens, step.max_len, kv_cache.shape[2])
        step.last = (seq_lens.long() - 1).unsqueeze(1)
    meta.scratch[_SCRATCH_KEY] = step
    return step


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    step: _Step,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the decodes' query tokens (``q``: [B, Hq, D]) over their context: float32 [B, Hq, D].

    Sequences go in chunks whose gathered K/V fit ``_CHUNK_BYTES``, so SDPA reads them from cache
    (an 8-bit cache's chunk is dequantized to float32 first).
    """
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    num_seqs, num_heads, head_dim = q.shape
    quantized = kv_format(kv_cache) is not None
    elem = 4 if quantized else kv_cache.element_size()  # of what SDPA reads
    seq_bytes = 2 * step.max_len * num_kv_heads * head_dim * elem
    chunk = max(1, min(num_seqs, _CHUNK_BYTES // seq_bytes))
    shape = (2, chunk * step.max_len, num_kv_heads, width)
    if step.buffer is None or step.buffer.shape != shape or step.buffer.dtype != kv_cache.dtype:
        step.buffer = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, width)
    mask = decode_mask(step.masks, step.last, step.max_len, sliding_window, q.device)
    # The query heads sharing a KV head become that head's query rows: one pass over its K/V serves them.
    q_grouped = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    group_sinks = head_sinks(sinks, num_kv_heads)
    out = None if chunk == num_seqs else q_grouped.new_empty(q_grouped.shape, dtype=torch.float32)
    for s in range(0, num_seqs, chunk):
        e = min(s + chunk, num_seqs)
        buf = step.buffer[:, : (e - s) * step.max_len]
        index = step.slots[s:e].flatten()
        torch.index_select(flat[0], 0, index, out=buf[0])
        torch.index_select(flat[1], 0, index, out=buf[1])
        ctx = buf.view(2, e - s, step.max_len, num_kv_heads, width)
        ctx = (dequantize(ctx) if quantized else ctx).transpose(2, 3)
        res = _sdpa(q_grouped[s:e], ctx[0], ctx[1], mask[s:e], scale, False, group_sinks)
        if out is None:
            return res.reshape(num_seqs, num_heads, head_dim)
        out[s:e] = res
    return out.view(num_seqs, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    b: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence's ``q_len`` new tokens ([q_len, H, D]) over its context."""
    q_len, seq_len = q.shape[0], meta.seq_lens_cpu[b]
    first = seq_len - q_len  # position of the first new token
    qh = q.transpose(0, 1).unsqueeze(0)
    if is_fresh_prefill(first, q_len, sliding_window):
        # No cached context and no effective window: the new K/V are the whole context.
        fmt = kv_format(kv_cache)
        k, v = roundtrip(k, fmt), roundtrip(v, fmt)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        res = _sdpa(qh, k, v, None, scale, True, head_sinks(sinks))
        return res[0].transpose(0, 1).to(q.dtype)
    start = context_start(first, sliding_window)
    k_ctx, v_ctx = _gather_context(kv_cache, meta.block_tables[b : b + 1], meta.seq_lens[b : b + 1], seq_len)
    k_ctx, v_ctx = k_ctx[0, start:].transpose(0, 1), v_ctx[0, start:].transpose(0, 1)  # [Hkv, L, D]
    mask = prefill_mask(first, seq_len, start, sliding_window, q.device)
    res = _sdpa(qh, k_ctx.unsqueeze(0), v_ctx.unsqueeze(0), mask, scale, False, head_sinks(sinks))
    return res[0].transpose(0, 1).to(q.dtype)
