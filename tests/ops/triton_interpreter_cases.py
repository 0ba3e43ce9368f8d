"""Cases for the Triton kernels of full decode graphs (``ops/triton_kernels/decode_attention.py``) and
of the CUDA quantized linears (``ops/triton_kernels/quantize.py``).

Run by ``test_triton_decode_attention.py`` in a fresh process with ``TRITON_INTERPRET=1`` (Triton
reads it when it is imported, which torch.compile may already have done in the suite's process):
the same kernel source CUDA compiles, executed by Triton's interpreter on CPU, checked against the
paged reference attention and the static torch reference on random caches, GQA groups that are not
powers of two, head sizes that need padding, several tiles per sequence, sliding windows and
padding rows; the per-token quantize bit for bit against the references' rounding (int8 and e4m3,
ties, the pad rows and columns, rows in one block and in several) and the W8A8 epilogue within
float32 rounding. On a CUDA machine this file runs as it is, on the device."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

pytest.importorskip("triton")

from ops.attention_metadata import build_attention_metadata  # noqa: E402
from ops.quant.fp8 import E4M3, quantize_fp8_rows  # noqa: E402
from ops.quant.int8 import quantize_int8  # noqa: E402
from ops.torch_ref.attention import attention as paged_attention  # noqa: E402
from ops.torch_ref.attention_static import attention_static as reference  # noqa: E402
from ops.triton_kernels.decode_attention import attention_static  # noqa: E402
from ops.triton_kernels.quantize import quantize_rows, scale_rows_cols  # noqa: E402

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


# ------------------------------------------------------------------ per-token quantize, W8A8 epilogue

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
REFERENCES = {torch.int8: quantize_int8, E4M3: quantize_fp8_rows}


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8) if q.dtype == E4M3 else q


def _check_quantized(x: torch.Tensor, dtype: torch.dtype, k_pad: int, m_pad: int, block: int) -> None:
    """Bit-equal q and equal scales against the reference on the CPU; pad columns and rows zero."""
    m, k = x.shape
    q, scale = quantize_rows(x.to(DEVICE), dtype, k_pad, m_pad, block=block)
    q, scale = q.cpu(), scale.cpu()
    want_q, want_scale = REFERENCES[dtype](x)
    assert q.dtype == dtype and q.shape == (max(m, m_pad), k_pad) and scale.shape == (max(m, m_pad), 1)
    assert torch.equal(scale[:m, 0], want_scale)
    assert torch.equal(_bits(q[:m, :k]), _bits(want_q))
    assert not _bits(q[:, k:]).any() and not _bits(q[m:]).any()


@pytest.mark.parametrize("dtype", [torch.int8, E4M3])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [8192, 64])  # the row in one block; in 4 blocks (two passes)
def test_quantize_rows_match_the_references(dtype: torch.dtype, x_dtype: torch.dtype, block: int) -> None:
    g = torch.Generator().manual_seed(block + x_dtype.itemsize)
    x = torch.randn(6, 200, generator=g) * torch.rand(6, 1, generator=g) * 8  # rows of mixed ranges
    x[2] = 0.0  # an all-zero row: scale 1, as the references'
    _check_quantized(x.to(x_dtype), dtype, 208, 8 if dtype == torch.int8 else 0, block)


def test_quantize_rounds_ties_to_even() -> None:
    """Rows whose max sets the scale to exactly 1: every x / scale is the value itself, so ties are
    exact (.5 for int8; midpoints of e4m3's grid, normal and subnormal); -0 and tiny values too."""
    halves = torch.cat([torch.tensor([127.0, 0.0, -0.0]), torch.arange(-127, 127) + 0.5])
    _check_quantized(halves[None], torch.int8, 264, 32, 8192)
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[~grid.isnan()].unique()  # all finite e4m3 values, ascending, 448 the largest
    midpoints = (grid[1:] + grid[:-1]) / 2
    row = torch.cat([grid, midpoints, torch.tensor([-0.0, 1e-12, -1e-12, 2.0**-11, -(2.0**-10)])])
    _check_quantized(row[None], E4M3, _round_up16(row.numel()), 0, 8192)
    _check_quantized(row[None], E4M3, _round_up16(row.numel()), 0, 128)


def _round_up16(n: int) -> int:
    return -(-n // 16) * 16


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_epilogue_within_float32_rounding(out_dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(7)
    acc = torch.randint(-(2**22), 2**22, (5, 1100), dtype=torch.int32, generator=g)  # 2 column blocks
    row_scale = torch.rand(8, 1, generator=g) * 1e-3  # more rows than acc: a padded GEMM's scales
    col_scale = torch.rand(1040, generator=g) * 1e-2
    bias = torch.randn(1040, generator=g) if with_bias else None
    sliced = acc[:, :1040]  # the GEMM's padded columns cut off: a strided view
    args = [t if t is None else t.to(DEVICE) for t in (sliced, row_scale, col_scale, bias)]
    got = scale_rows_cols(*args, out_dtype).cpu()
    exact = sliced.double() * row_scale[:5].double() * col_scale.double()
    size = exact.abs()
    if bias is not None:
        exact, size = exact + bias.double(), size + bias.double().abs()
    assert got.dtype == out_dtype and got.shape == (5, 1040)
    # three float32 roundings of terms no larger than ``size``, then one step of the output dtype
    # (Triton's interpreter truncates float32 to bfloat16; the GPU rounds to nearest)
    output_ulp = 0.0 if out_dtype == torch.float32 else 2.0**-7
    bound = 3 * 2.0**-24 * size + output_ulp * exact.abs()
    assert ((got.double() - exact).abs() <= bound * (1 + 1e-6)).all()
