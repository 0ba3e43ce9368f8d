"""Reference paged attention vs a dense float64 causal attention over the same K/V."""

from __future__ import annotations

import random

import pytest
import torch

from ops.attention import attention, build_attention_metadata
from ops.kv_store import store_kv


def _dense(q, k, v, first_pos: int, scale: float, window: int | None) -> torch.Tensor:
    """q [Lq, Hq, D] at positions first_pos.., k/v [L, Hkv, D] for positions 0..L-1 -> [Lq, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _run_case(query_lens, seq_lens, num_heads, num_kv_heads, block_size, window, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head_dim, num_blocks = 16, 128
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    ks = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    qs = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in query_lens]
    # earlier context (chunked prefill / prefix hit / previous decodes) is already in the cache
    ctx_lens = [s - n for s, n in zip(seq_lens, query_lens)]
    ctx = build_attention_metadata(ctx_lens, ctx_lens, tables, block_size)
    store_kv(torch.cat([k[:c] for k, c in zip(ks, ctx_lens)]), torch.cat([v[:c] for v, c in zip(vs, ctx_lens)]),
             cache, ctx.slot_mapping)  # fmt: skip
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    new_k = torch.cat([k[c:] for k, c in zip(ks, ctx_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(vs, ctx_lens)])
    scale = head_dim**-0.5
    out = attention(torch.cat(qs), new_k, new_v, cache, meta, scale, window)
    assert out.dtype == dtype and out.shape == (sum(query_lens), num_heads, head_dim)
    ref = torch.cat([_dense(q, k, v, c, scale, window) for q, k, v, c in zip(qs, ks, vs, ctx_lens)])
    return out.double(), ref


MIXED = ([1, 7, 1, 5, 1, 12], [9, 7, 1, 13, 30, 12])  # decodes interleaved with prefills / chunks


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 4])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, block_size, window) -> None:
    out, ref = _run_case(*MIXED, num_heads, num_kv_heads, block_size, window, torch.float32)
    assert (out - ref).abs().max().item() < 1e-5


def test_all_decode_batch() -> None:
    out, ref = _run_case([1, 1, 1, 1], [1, 17, 5, 33], 4, 2, 4, None, torch.float32)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [None, 6])
def test_decodes_gathered_in_chunks(monkeypatch, window) -> None:
    # A budget of under one sequence's context makes every decode its own gather + SDPA chunk.
    monkeypatch.setattr("ops.torch_ref.attention._CHUNK_BYTES", 1)
    out, ref = _run_case([1, 1, 3, 1, 1], [1, 17, 9, 5, 33], 4, 2, 4, window, torch.float32)
    assert (out - ref).abs().max().item() < 1e-5


def test_step_values_are_shared_across_layers() -> None:
    # Two layers (caches, windows) attending with one metadata: per-step values built by the first
    # layer must serve the second.
    gen = torch.Generator().manual_seed(3)
    seq_lens, block_size, tables = [5, 12, 1], 4, [[3, 7], [0, 1, 2], [6]]
    meta = build_attention_metadata([1, 1, 1], seq_lens, tables, block_size)
    for window in (None, 3):
        cache = torch.randn(2, 8, block_size, 2, 16, generator=gen)
        q, k, v = (
            torch.randn(3, 4, 16, generator=gen),
            torch.randn(3, 2, 16, generator=gen),
            torch.randn(3, 2, 16, generator=gen),
        )
        out = attention(q, k, v, cache, meta, 0.25, window)
        for b, (n, blocks) in enumerate(zip(seq_lens, tables)):
            slots = [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
            flat = cache.view(2, -1, 2, 16)
            ref = _dense(q[b : b + 1], flat[0, slots], flat[1, slots], n - 1, 0.25, window)
            assert (out[b : b + 1].double() - ref).abs().max().item() < 1e-5


def test_all_prefill_with_large_window_and_prefix() -> None:
    out, ref = _run_case([6, 3], [6, 20], 4, 2, 4, 64, torch.float32)
    assert (out - ref).abs().max().item() < 1e-5


def test_bfloat16_cache() -> None:
    out, ref = _run_case(*MIXED, 4, 2, 4, 5, torch.bfloat16)
    assert (out - ref).abs().max().item() < 3e-2


def test_new_kv_is_written_to_slots() -> None:
    cache = torch.zeros(2, 4, 2, 1, 3)
    meta = build_attention_metadata([3], [3], [[2, 0]], 2)
    k = torch.arange(9.0).reshape(3, 1, 3)
    attention(torch.randn(3, 1, 3), k, -k, cache, meta, 1.0)
    assert torch.equal(cache[0, 2], k[:2])  # positions 0, 1 -> block 2
    assert torch.equal(cache[0, 0, 0], k[2])  # position 2 -> block 0 offset 0
    assert torch.equal(cache[1, 2], -k[:2])
    assert meta.slot_mapping.tolist() == [4, 5, 0]


FRESH_RUNS = ([8, 8, 8, 5, 8, 8, 8, 3, 8, 8], [8, 8, 8, 5, 8, 12, 8, 3, 8, 8])  # 12: a cached prefix


@pytest.mark.parametrize("window", [None, 4, 16])
def test_fresh_prompts_of_one_length_share_an_sdpa_call(monkeypatch, window) -> None:
    """Consecutive whole prompts of one length go through one batched SDPA call: the same bits as
    one call each, and every other chunk (cached prefix, effective window) still runs alone."""
    from ops.torch_ref import attention as ref

    meta = build_attention_metadata(*FRESH_RUNS, [[i] for i in range(10)], 16)
    runs = ref._prefill_runs(meta, window)
    if window == 4:  # the window cuts into every prompt longer than 4: no runs
        assert runs == [(b, b + 1) for b in range(10)]
    else:
        assert runs == [(0, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 10)]
    monkeypatch.setattr("ops.attention.get_op", lambda name: ref.attention)  # the reference itself
    out, dense = _run_case(*FRESH_RUNS, 4, 2, 4, window, torch.float32)
    assert (out - dense).abs().max().item() < 1e-5
    monkeypatch.setattr(ref, "_prefill_runs", lambda meta, window: [(b, b + 1) for b in range(10)])
    alone, _ = _run_case(*FRESH_RUNS, 4, 2, 4, window, torch.float32)
    assert torch.equal(out, alone)
