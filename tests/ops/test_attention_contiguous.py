"""Contiguous (xTensor) attention vs a dense float64 causal attention, over real xTensor memory.

Sequences sit in slots of an ``XTensorKVLayout`` (memfd pages mapped into reserved ranges); their
context is written through the paged view and read in place through the slots. Decodes whose slots
are not consecutive (holes, other chunks, prefills in between) exercise the run splitting.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import _dense

from memory.kv_layout import KVCacheSpec
from memory.xtensor import XTensorKVLayout
from ops.attention import attention, build_attention_metadata
from ops.kv_store import store_kv
from ops.platforms import resolve_platform

HEAD_DIM = 64  # a block of one layer's K must fill whole 4 KiB pages


def _layout(num_kv_heads: int, block_size: int, dtype: torch.dtype, slots_per_chunk: int = 4):
    layout = XTensorKVLayout(resolve_platform("cpu").vmm(), max_model_len=64, slots_per_chunk=slots_per_chunk)
    spec = KVCacheSpec(1, num_kv_heads, HEAD_DIM, block_size, dtype)
    caches = layout.allocate(spec, 64, torch.device("cpu"))
    return layout, caches[0], layout.attention_caches(caches)[0]


def _run(query_lens, seq_lens, slots, num_heads, num_kv_heads, block_size, window, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layout, paged, kv = _layout(num_kv_heads, block_size, dtype)
    try:
        next_block = iter(range(63, -1, -1))  # scattered, descending block ids
        tables = [[next(next_block) for _ in range(-(-s // block_size))] for s in seq_lens]
        for slot in range(max(slots) + 1):  # occupy the slots in order, so sequence b gets slots[b]
            layout.preferred_blocks(f"s{slot}", 0, 0)  # (assigns the lowest free slot)
        for slot in set(range(max(slots) + 1)) - set(slots):
            layout.released(f"s{slot}")
        got = layout.prepare([(f"s{s}", t, n) for s, t, n in zip(slots, tables, seq_lens)])
        assert got == slots
        ks = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
        vs = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for s in seq_lens]
        qs = [torch.randn(n, num_heads, HEAD_DIM, generator=gen).to(dtype) for n in query_lens]
        ctx_lens = [s - n for s, n in zip(seq_lens, query_lens)]
        ctx = build_attention_metadata(ctx_lens, ctx_lens, tables, block_size)
        store_kv(torch.cat([k[:c] for k, c in zip(ks, ctx_lens)]), torch.cat([v[:c] for v, c in zip(vs, ctx_lens)]),
                 paged, ctx.slot_mapping)  # fmt: skip
        meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
        meta.kv_slots = slots
        new_k = torch.cat([k[c:] for k, c in zip(ks, ctx_lens)])
        new_v = torch.cat([v[c:] for v, c in zip(vs, ctx_lens)])
        scale = HEAD_DIM**-0.5
        out = attention(torch.cat(qs), new_k, new_v, kv, meta, scale, window)
        ref = torch.cat([_dense(q, k, v, c, scale, window) for q, k, v, c in zip(qs, ks, vs, ctx_lens)])
        return out.double(), ref
    finally:
        layout.close()


MIXED = ([1, 7, 1, 5, 1, 12, 1], [9, 7, 1, 13, 30, 12, 40])
# decode slots 0, 2 (hole at 1), 5 (next chunk), 6; prefills elsewhere
SLOTS = [0, 1, 2, 3, 5, 4, 6]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 4])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, block_size, window) -> None:
    out, ref = _run(*MIXED, SLOTS, num_heads, num_kv_heads, block_size, window, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_all_decodes_in_one_run_in_batch_order() -> None:
    out, ref = _run([1] * 4, [3, 17, 33, 2], [0, 1, 2, 3], 4, 2, 16, None, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_decodes_out_of_slot_order() -> None:
    out, ref = _run([1] * 4, [3, 17, 33, 2], [3, 1, 0, 2], 4, 2, 16, None, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_bfloat16_cache() -> None:
    out, ref = _run(*MIXED, SLOTS, 4, 2, 32, None, torch.bfloat16)
    torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
