"""Cases for the Triton kernels of full decode graphs (``ops/triton_kernels/decode_attention.py``).

Run by ``test_triton_decode_attention.py`` in a fresh process with ``TRITON_INTERPRET=1`` (Triton
reads it when it is imported, which torch.compile may already have done in the suite's process):
the same kernel source CUDA compiles, executed by Triton's interpreter on CPU, checked against the
paged reference attention and the static torch reference on random caches, GQA groups that are not
powers of two, head sizes that need padding, several tiles per sequence, sliding windows and
padding rows. On a CUDA machine this file runs as it is, on the device."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

pytest.importorskip("triton")

from ops.attention_metadata import build_attention_metadata  # noqa: E402
from ops.torch_ref.attention import attention as paged_attention  # noqa: E402
from ops.torch_ref.attention_static import attention_static as reference  # noqa: E402
from ops.triton_kernels.decode_attention import attention_static  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the kernels run on CUDA or in Triton's interpreter",
)


def _case(heads: int, kv_heads: int, dim: int, block: int, lens: list[int], dtype: torch.dtype, seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block) for n in lens) + 4
    cache = torch.randn(2, num_blocks, block, kv_heads, dim).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    meta = build_attention_metadata([1] * len(lens), lens, tables, block)
    q = torch.randn(len(lens), heads, dim)
    k, v = torch.randn(len(lens), kv_heads, dim), torch.randn(len(lens), kv_heads, dim)
    return cache, meta, q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block,lens",
    [
        (4, 2, 32, 16, [1, 17, 40, 100]),  # several 32-token tiles, a partial last block
        (6, 2, 48, 4, [3, 70, 9]),  # groups of 3, head_dim 48: both padded to powers of two
        (8, 8, 16, 8, [33, 1]),  # no grouping
        (16, 1, 64, 16, [129]),  # one KV head for 16 query heads
    ],
)
@pytest.mark.parametrize("window", [None, 20])
def test_triton_matches_the_references(heads, kv_heads, dim, block, lens, window) -> None:
    cache, meta, q, k, v = _case(heads, kv_heads, dim, block, lens, torch.float32, seed=len(lens) + dim)
    want_cache = cache.clone()
    want = paged_attention(q, k, v, want_cache, meta, dim**-0.5, window)
    static = dataclasses.replace(meta, static=True, query_lens_cpu=[], seq_lens_cpu=[])
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = reference(q, k, v, ref_cache, static, dim**-0.5, window)
    got = attention_static(q, k, v, got_cache, static, dim**-0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_cache, want_cache) and torch.equal(ref_cache, want_cache)


def test_padding_rows_and_strided_inputs() -> None:
    """Rows with length 0 and slot -1 (a bucket's padding) read and write nothing and come out as
    zeros; k and v arrive as strided slices of one projection, as the models pass them."""
    cache, meta, q, _, _ = _case(4, 2, 32, 16, [5, 50], torch.float32, seed=3)
    qkv = torch.randn(3, (4 + 2 + 2) * 32)
    q = qkv[:, : 4 * 32].view(3, 4, 32)
    k, v = qkv[:, 4 * 32 : 6 * 32].view(3, 2, 32), qkv[:, 6 * 32 :].view(3, 2, 32)
    padded = dataclasses.replace(
        meta,
        seq_lens=torch.tensor([5, 50, 0], dtype=torch.int32),
        block_tables=torch.cat([meta.block_tables, meta.block_tables[:1]]),
        slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([-1])]),
        static=True,
    )
    want_cache = cache.clone()
    want = paged_attention(q[:2], k[:2], v[:2], want_cache, meta, 0.2)
    got_cache = cache.clone()
    got = attention_static(q, k, v, got_cache, padded, 0.2)
    torch.testing.assert_close(got[:2], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert torch.equal(got_cache, want_cache)


def test_half_precision_cache() -> None:
    cache, meta, q, k, v = _case(4, 2, 32, 16, [7, 64], torch.float16, seed=5)
    static = dataclasses.replace(meta, static=True)
    want_cache = cache.clone()
    want = reference(q, k, v, want_cache, static, 0.2)
    got_cache = cache.clone()
    got = attention_static(q, k, v, got_cache, static, 0.2)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert torch.equal(got_cache, want_cache)
