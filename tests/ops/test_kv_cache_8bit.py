"""8-bit KV cache (int8 / fp8 rows with a float32 scale each, ``ops/kv_quant.py``) at the op level.

The oracle is the same arithmetic in float64: quantize K/V per row, dequantize, attend. The torch
reference must match it; the C kernels (quantizing store, ``_q8`` decode attention, paged and xTensor)
must write the reference's bytes and attend within float32 rounding of the reference.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_attention import _dense

from memory.kv_layout import KVCacheSpec, PagedKVLayout
from memory.xtensor import XTensorKVLayout
from ops.attention import attention, build_attention_metadata
from ops.cpu_kernels import attention as cpu_attention
from ops.cpu_kernels.build import unavailable_reason
from ops.kv_quant import STORAGE_DTYPES, dequantize, quantize, scales
from ops.platforms import resolve_platform
from ops.torch_ref import attention as ref
from ops.torch_ref import attention_contiguous as ref_contiguous
from ops.torch_ref.attention_static import attention_static
from ops.torch_ref.kv_store import store_kv

FORMATS = ("int8", "fp8")
DTYPES = (torch.float32, torch.bfloat16)
MIXED = ([1, 7, 1, 5, 1, 12, 1], [9, 7, 1, 13, 300, 12, 1000])  # decodes beside fresh prompts and chunks


def _kernels_or_skip() -> None:
    reason = unavailable_reason("decode_attention")
    if reason is not None:
        pytest.skip(reason)


def _close(out: torch.Tensor, ref_out: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the float32 result
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------- the format


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_hold_values_then_their_scale(fmt: str) -> None:
    x = torch.randn(6, 3, 32, generator=torch.Generator().manual_seed(0))
    x[2, 1] = 0.0
    rows = quantize(x, fmt)
    assert rows.dtype == STORAGE_DTYPES[fmt] and rows.shape == (6, 3, 36)
    amax = x.abs().amax(-1, keepdim=True)
    expected = torch.where(amax > 0, amax / (127.0 if fmt == "int8" else 448.0), torch.ones_like(amax))
    assert torch.equal(scales(rows), expected)
    assert torch.equal(dequantize(rows)[2, 1], torch.zeros(32))
    err = (dequantize(rows) - x).abs()
    if fmt == "int8":  # half a step
        assert bool((err <= scales(rows) / 2 * (1 + 1e-6)).all())
    else:  # e4m3: 3 mantissa bits, nearest, for values in its normal range
        normal = x.abs() / scales(rows) >= 2**-6
        assert bool((err[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-6)).all())


def _edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows that probe rounding: exact halves between int8 steps and between fp8 values (scale 1 via
    a lead of 127 / 448), subnormals, zeros, magnitudes from 1e-30 to 1e3."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 64, generator=gen) * torch.logspace(-30, 3, 64)[:, None, None]
    fp8_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fp8_values = fp8_values[fp8_values.isfinite()].unique()
    halves = (fp8_values[1:] + fp8_values[:-1]) / 2
    x[0, :, 0], x[0, :, 1:] = 448.0, halves[torch.randint(0, len(halves), (4, 63), generator=gen)]
    x[1, :, 0], x[1, :, 1:] = 127.0, torch.randint(-254, 254, (4, 63), generator=gen) / 2
    x[2] = 0.0
    x[3, 0, :] = 1e-41  # subnormal float32
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_c_store_writes_the_reference_bytes(fmt: str, dtype: torch.dtype) -> None:
    _kernels_or_skip()
    k, v = _edge_rows(dtype), _edge_rows(dtype).flip(0)
    slots = torch.randperm(80, generator=torch.Generator().manual_seed(2))[:64]
    want = torch.zeros(2, 10, 8, 4, 68, dtype=STORAGE_DTYPES[fmt])
    got = want.clone()
    store_kv(k, v, want, slots)
    cpu_attention._store_kv(k, v, got, slots)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------- paged attention


def _fill(cache, query_lens, seq_lens, tables, block_size, num_heads, dtype, seed=0):
    """Random K/V of every sequence, the context part stored; the step's q / new K / new V and the
    float64 oracle over the dequantized K/V (what the cache holds)."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = cache.shape[-2], cache.shape[-1] - 4
    ks = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    qs = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in query_lens]
    ctx = [s - n for s, n in zip(seq_lens, query_lens)]
    meta = build_attention_metadata(ctx, ctx, tables, block_size)
    store_kv(torch.cat([k[:c] for k, c in zip(ks, ctx)]), torch.cat([v[:c] for v, c in zip(vs, ctx)]),
             cache, meta.slot_mapping)  # fmt: skip
    new_k = torch.cat([k[c:] for k, c in zip(ks, ctx)])
    new_v = torch.cat([v[c:] for v, c in zip(vs, ctx)])
    fmt = "int8" if cache.dtype == torch.int8 else "fp8"
    dq = [(dequantize(quantize(k, fmt)), dequantize(quantize(v, fmt))) for k, v in zip(ks, vs)]

    def oracle(scale: float, window: int | None) -> torch.Tensor:
        return torch.cat([_dense(q, k, v, c, scale, window) for q, (k, v), c in zip(qs, dq, ctx)])

    return torch.cat(qs), new_k, new_v, oracle


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,window", [((8, 2), None), ((4, 4), 50), ((8, 1), None)])
def test_paged_kernel_matches_reference_and_oracle(fmt, dtype, heads, window) -> None:
    _kernels_or_skip()
    num_heads, num_kv_heads = heads
    block_size, head_dim = 16, 64
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, dtype, fmt)
    cache = PagedKVLayout().allocate(spec, 100, torch.device("cpu"))[0]
    free = list(range(100))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in MIXED[1]]
    q, k, v, oracle = _fill(cache, *MIXED, tables, block_size, num_heads, dtype)
    scale = head_dim**-0.5
    ref_cache = cache.clone()
    meta = build_attention_metadata(*MIXED, tables, block_size)
    assert cpu_attention._usable(q, cache, meta), "the q8 kernel must take this step"
    out = attention(q, k, v, cache, meta, scale, window)
    ref_out = ref.attention(
        q, k, v, ref_cache, build_attention_metadata(*MIXED, tables, block_size), scale, window
    )
    assert out.dtype == dtype
    assert torch.equal(cache, ref_cache)  # the step's rows stored as the reference stores them
    _close(out, ref_out, dtype)
    want = oracle(scale, window)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bfloat16 q and K/V before quantization
    torch.testing.assert_close(ref_out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_hit_attends_as_the_fresh_prompt(fmt: str) -> None:
    """A prompt computed in one fresh prefill and the same prompt whose first 32 tokens come from the
    cache (a prefix hit) attend over the same values: the fresh one over its K/V quantized and back."""
    block_size, length = 16, 45
    spec = KVCacheSpec(1, 2, 32, block_size, torch.float32, fmt)
    fresh, hit = (PagedKVLayout().allocate(spec, 4, torch.device("cpu"))[0] for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(length, h, 32, generator=gen) for h in (4, 2, 2))
    tables = [[0, 1, 2]]
    out_fresh = ref.attention(q, k, v, fresh, build_attention_metadata([length], [length], tables, 16), 0.2)
    store_kv(k[:32], v[:32], hit, build_attention_metadata([32], [32], tables, 16).slot_mapping)
    meta = build_attention_metadata([length - 32], [length], tables, 16)
    out_hit = ref.attention(q[32:], k[32:], v[32:], hit, meta, 0.2)
    assert torch.equal(fresh, hit)
    torch.testing.assert_close(out_hit, out_fresh[32:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_static_reference_reads_8bit_blocks(fmt: str) -> None:
    """The full-graph decode reference (``attention_static``) dequantizes as the paged one does."""
    spec = KVCacheSpec(1, 2, 32, 4, torch.float32, fmt)
    cache = PagedKVLayout().allocate(spec, 16, torch.device("cpu"))[0]
    tables = [[3, 1, 7], [0, 5, 2]]
    q, k, v, oracle = _fill(cache, [1, 1], [11, 6], tables, 4, 4, torch.float32)
    meta = build_attention_metadata([1, 1], [11, 6], tables, 4)
    out = attention_static(q, k, v, cache, meta, 0.3)
    torch.testing.assert_close(out.double(), oracle(0.3, None), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- xTensor attention


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_xtensor_kernel_matches_reference_and_oracle(fmt: str, dtype: torch.dtype) -> None:
    _kernels_or_skip()
    # a block of one layer's K is 256 tokens x 4 heads x 68 bytes: whole 4 KiB pages
    block_size, num_kv_heads, head_dim = 256, 4, 64
    layout = XTensorKVLayout(resolve_platform("cpu").vmm(), max_model_len=1024, slots_per_chunk=2)
    try:
        spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, dtype, fmt)
        paged = layout.allocate(spec, 16, torch.device("cpu"))[0]
        kv = layout.attention_caches([paged])[0]
        query_lens, seq_lens = [1, 30, 1, 1], [300, 30, 5, 700]
        tables = [[15, 3], [7], [9], [0, 1, 2]]
        slots = layout.prepare([(f"s{b}", t, n) for b, (t, n) in enumerate(zip(tables, seq_lens))])
        q, k, v, oracle = _fill(paged, query_lens, seq_lens, tables, block_size, 8, dtype)
        scale = head_dim**-0.5
        meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
        meta.kv_slots = slots
        assert cpu_attention._usable(q, paged, meta), "the q8 kernel must take this step"
        before = paged.clone()
        out = attention(q, k, v, kv, meta, scale)
        after = paged.clone()
        paged.copy_(before)
        ref_meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
        ref_meta.kv_slots = slots
        ref_out = ref_contiguous.attention_contiguous(q, k, v, kv, ref_meta, scale)
        assert torch.equal(paged, after)
        _close(out, ref_out, dtype)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(ref_out.double(), oracle(scale, None), rtol=tol, atol=tol)
    finally:
        layout.close()
