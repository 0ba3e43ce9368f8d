"""Attention sinks (one learned logit per query head in every softmax's denominator) against a dense
float64 formula, through the ``ops.attention`` facade on this platform (the CPU registers C decode
kernels, which have no sink term: sinks must reach the reference, never be dropped), the xTensor
layout, and the opaque graph op."""

from __future__ import annotations

import random

import pytest
import torch

from graph.attention_op import unified_attention
from graph.forward_context import forward_context
from memory.kv_layout import KVCacheSpec
from memory.xtensor import XTensorKVLayout
from ops.attention import attention, build_attention_metadata
from ops.kv_store import store_kv
from ops.platforms import resolve_platform

HEAD_DIM = 64  # xTensor: a block of one layer's K fills whole 4 KiB pages


def _dense_with_sinks(q, k, v, first_pos, scale, window, sinks) -> torch.Tensor:
    """q [Lq, Hq, D] at positions first_pos.., k/v [L, Hkv, D] at 0..L-1, sinks [Hq] -> [Lq, Hq, D]:
    ``softmax([scores, sink])`` with the sink's column dropped."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


class _Case:
    """Random q/k/v of a batch whose earlier context is already in ``cache``; ``meta`` is the step."""

    def __init__(self, query_lens, seq_lens, num_heads, num_kv_heads, cache, block_size, seed=0):
        gen = torch.Generator().manual_seed(seed)
        free = list(range(cache.shape[1]))
        random.Random(seed).shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
        dtype = cache.dtype
        self.ks = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
        self.vs = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
        self.qs = [torch.randn(n, num_heads, HEAD_DIM, generator=gen).to(dtype) for n in query_lens]
        self.sinks = 2.0 * torch.randn(num_heads, generator=gen)  # large enough to matter
        self.ctx_lens = [s - n for s, n in zip(seq_lens, query_lens)]
        self.query_lens, self.seq_lens, self.block_size = query_lens, seq_lens, block_size

    def store_context(self, paged: torch.Tensor) -> None:
        ctx = build_attention_metadata(self.ctx_lens, self.ctx_lens, self.tables, self.block_size)
        k = torch.cat([k[:c] for k, c in zip(self.ks, self.ctx_lens)])
        v = torch.cat([v[:c] for v, c in zip(self.vs, self.ctx_lens)])
        store_kv(k, v, paged, ctx.slot_mapping)

    def step(self):
        meta = build_attention_metadata(self.query_lens, self.seq_lens, self.tables, self.block_size)
        q = torch.cat(self.qs)
        k = torch.cat([k[c:] for k, c in zip(self.ks, self.ctx_lens)])
        v = torch.cat([v[c:] for v, c in zip(self.vs, self.ctx_lens)])
        return q, k, v, meta

    def reference(self, scale: float, window: int | None) -> torch.Tensor:
        parts = zip(self.qs, self.ks, self.vs, self.ctx_lens)
        return torch.cat([_dense_with_sinks(q, k, v, c, scale, window, self.sinks) for q, k, v, c in parts])


def _paged(num_kv_heads: int, block_size: int, dtype=torch.float32) -> torch.Tensor:
    return torch.full((2, 64, block_size, num_kv_heads, HEAD_DIM), float("nan"), dtype=dtype)


def _run_paged(query_lens, seq_lens, num_heads, num_kv_heads, block_size, window, dtype=torch.float32):
    cache = _paged(num_kv_heads, block_size, dtype)
    case = _Case(query_lens, seq_lens, num_heads, num_kv_heads, cache, block_size)
    case.store_context(cache)
    q, k, v, meta = case.step()
    scale = HEAD_DIM**-0.5
    out = attention(q, k, v, cache, meta, scale, window, case.sinks)
    assert out.dtype == dtype and out.shape == q.shape
    return out.double(), case.reference(scale, window)


MIXED = ([1, 7, 1, 5, 1, 12], [9, 7, 1, 13, 30, 12])  # decodes, a fresh prompt, chunks after context
PREFILL = ([6, 40], [6, 70])  # a prompt longer than the window, a chunk far past it
DECODE = ([1, 1, 1, 1], [1, 17, 5, 33])
FRESH_RUN = ([5, 5, 5], [5, 5, 5])  # whole prompts of one length: one batched call


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize(
    "batch", [MIXED, PREFILL, DECODE, FRESH_RUN], ids=["mixed", "prefill", "decode", "fresh"]
)
def test_paged_matches_dense_softmax_with_sink(num_heads, num_kv_heads, window, batch) -> None:
    out, ref = _run_paged(*batch, num_heads, num_kv_heads, 16, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decodes_gathered_in_chunks(monkeypatch) -> None:
    monkeypatch.setattr("ops.torch_ref.attention._CHUNK_BYTES", 1)  # every decode its own chunk
    out, ref = _run_paged([1, 1, 3, 1, 1], [1, 17, 9, 5, 33], 4, 2, 4, 6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_decodes_take_the_sinks() -> None:
    """bfloat16 decodes are what the CPU's C kernel takes without sinks: with them, the reference."""
    out, ref = _run_paged(*DECODE, 4, 2, 16, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [None, 4])
def test_xtensor_matches_dense_softmax_with_sink(window) -> None:
    query_lens, seq_lens, slots, block_size = [1, 7, 1, 5, 1], [9, 7, 1, 13, 30], [0, 1, 2, 3, 4], 16
    layout = XTensorKVLayout(resolve_platform("cpu").vmm(), max_model_len=64, slots_per_chunk=8)
    try:
        caches = layout.allocate(
            KVCacheSpec(1, 2, HEAD_DIM, block_size, torch.float32), 64, torch.device("cpu")
        )
        case = _Case(query_lens, seq_lens, 4, 2, caches[0], block_size)
        for slot in slots:
            layout.preferred_blocks(f"s{slot}", 0, 0)  # (assigns the lowest free slot)
        assert layout.prepare([(f"s{s}", t, n) for s, t, n in zip(slots, case.tables, seq_lens)]) == slots
        case.store_context(caches[0])
        q, k, v, meta = case.step()
        meta.kv_slots = slots
        kv = layout.attention_caches(caches)[0]
        out = attention(q, k, v, kv, meta, HEAD_DIM**-0.5, window, case.sinks)
        torch.testing.assert_close(out.double(), case.reference(HEAD_DIM**-0.5, window), rtol=1e-5, atol=1e-5)
    finally:
        layout.close()


def test_graph_op_passes_the_sinks() -> None:
    """Through the opaque op; the same step without sinks (plain softmax) is far from the formula."""
    cache = _paged(2, 16)
    case = _Case(*MIXED, 4, 2, cache, 16)
    case.store_context(cache)
    q, k, v, meta = case.step()
    ref = case.reference(HEAD_DIM**-0.5, 4)
    with forward_context(meta, [cache], q.shape[0]):
        out = unified_attention(q, k, v, 0, HEAD_DIM**-0.5, 4, case.sinks)
        plain = unified_attention(q, k, v, 0, HEAD_DIM**-0.5, 4)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert (plain.double() - ref).abs().max().item() > 1e-2


def test_full_device_graphs_refuse_sinks() -> None:
    cache = _paged(2, 16)
    case = _Case(*DECODE, 4, 2, cache, 16)
    q, k, v, meta = case.step()
    meta.static = True
    with pytest.raises(ValueError, match="attention sinks do not run under full device graphs"):
        attention(q, k, v, cache, meta, HEAD_DIM**-0.5, None, case.sinks)
