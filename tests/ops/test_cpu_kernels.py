"""The C kernels of the CPU backend (``ops/cpu_kernels``) against float64 references.

The panel GEMM over tail shapes, biases, both weight layouts, 1 and 2 threads, and rows past its
limit (``F.linear``); decode attention over the paged cache and xTensor slots, GQA groups, sliding
windows and lengths that end mid-block, checked to run the kernel rather than the reference; the
same in bfloat16 against the float32 reference rounded to bfloat16.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from test_attention import _dense
from test_cpu_elementwise import assert_within_one_bf16_ulp

from memory.kv_layout import KVCacheSpec
from memory.xtensor import XTensorKVLayout
from ops.attention import ContiguousKV, build_attention_metadata
from ops.cpu_kernels import attention as kernel_attention
from ops.cpu_kernels.build import AVX2_BUILDS, SIGNATURES, build_all, kernel_library, unavailable_reason
from ops.cpu_kernels.linear import PanelLinear
from ops.kv_store import store_kv
from ops.platforms import resolve_platform

# decode attention, argmax and the elementwise kernels build for AVX2 CPUs too; the panel GEMMs need AVX-512
pytestmark = pytest.mark.skipif(
    kernel_library("decode_attention") is None,
    reason=f"CPU kernels unavailable: {unavailable_reason('decode_attention')}",
)
needs_panel = pytest.mark.skipif(
    kernel_library("panel_gemm") is None,
    reason=f"panel GEMM unavailable: {unavailable_reason('panel_gemm')}",
)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_every_kernel_builds() -> None:
    """The kernels this CPU can run build here: every one on AVX-512 (those needing more, as
    ``panel_gemm_bf16``, may say why not), those of ``AVX2_BUILDS`` on AVX2 + FMA + F16C."""
    from ops.platforms.cpu_features import cpu_features

    results = build_all()
    assert set(results) == set(SIGNATURES)
    assert {name: results[name] for name in AVX2_BUILDS} == dict.fromkeys(AVX2_BUILDS, "ok")
    features = cpu_features()
    if not features.avx512f:
        assert features.avx2_fma_f16c
        assert all("lacks AVX-512" in results[name] for name in SIGNATURES if name not in AVX2_BUILDS)
        return
    assert results["panel_gemm"] == "ok"
    has_bf16 = features.avx512_bf16
    assert (results["panel_gemm_bf16"] == "ok") == has_bf16
    assert has_bf16 or "avx512_bf16" in results["panel_gemm_bf16"]


@needs_panel
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(
    "rows,k,n",
    [(1, 64, 40), (2, 64, 40), (5, 128, 33), (13, 96, 100), (32, 512, 1024), (128, 80, 7), (300, 256, 129)],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_major", [False, True])
def test_panel_linear_matches_float64(threads, rows, k, n, bias, input_major) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    weight = torch.randn(n, k, generator=gen)
    if input_major:  # stored as the transpose of [in, out], as the decoder's weights are
        weight = weight.t().contiguous().t()
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    out = PanelLinear(weight, b, kernel_library("panel_gemm"))(x)
    ref = x.double() @ weight.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@needs_panel
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_panel_linear_rows_do_not_depend_on_the_batch(threads) -> None:
    """Skinny and wide inputs, split by panel or (wide, 2 threads) by row block: every row's result
    is the same bits whatever shares its call."""
    gen = torch.Generator().manual_seed(0)
    layer = PanelLinear(torch.randn(300, 256, generator=gen), None, kernel_library("panel_gemm"))
    x = torch.randn(2000, 256, generator=gen)
    full = layer(x)  # wide: x packed in row blocks, one range of blocks per thread
    for rows in (1, 2, 7, 13, 24, 25, 40, 200, 999):  # skinny (up to 24 rows): x read in place
        assert torch.equal(layer(x[:rows]), full[:rows])  # bit-identical: one FMA chain per element
    assert torch.equal(layer(x[1001:1400]), full[1001:1400])  # other row-block boundaries


@needs_panel
def test_panel_linear_wide_inputs_and_views() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(64, 48, generator=gen), torch.randn(64, generator=gen)
    layer = PanelLinear(weight, bias, kernel_library("panel_gemm"))
    wide = torch.randn(301, 48, generator=gen)
    torch.testing.assert_close(layer(wide), F.linear(wide, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(torch.empty(0, 48)), torch.empty(0, 64))
    strided = torch.randn(3, 5, 96, generator=gen)[..., ::2]  # non-contiguous, with leading dims
    torch.testing.assert_close(layer(strided), F.linear(strided, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.fixture
def kernel_only(monkeypatch):
    """Fail if the op falls back to the torch reference."""

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran instead of the kernel")

    monkeypatch.setattr(kernel_attention, "reference_attention", refuse)
    monkeypatch.setattr(kernel_attention, "reference_contiguous", refuse)


def _decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, gen):
    ks = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return ks, vs, q


def _reference(q, ks, vs, seq_lens, scale, window):
    return torch.cat(
        [_dense(q[b : b + 1], ks[b], vs[b], n - 1, scale, window) for b, n in enumerate(seq_lens)]
    )


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (4, 2, 32), (16, 1, 128), (4, 2, 16)]
)
@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("block_size,seq_lens", [(16, [1, 16, 17, 40, 100, 3]), (128, [300, 129, 64, 1])])
def test_paged_decode_attention_matches_dense(
    kernel_only, threads, num_heads, num_kv_heads, head_dim, window, block_size, seq_lens
):
    gen = torch.Generator().manual_seed(num_heads + head_dim)
    num_blocks = 96
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    ks, vs, q = _decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, gen)
    ctx = build_attention_metadata([s - 1 for s in seq_lens], [s - 1 for s in seq_lens], tables, block_size)
    store_kv(torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), cache, ctx.slot_mapping)
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    scale = head_dim**-0.5
    new_k, new_v = torch.cat([k[-1:] for k in ks]), torch.cat([v[-1:] for v in vs])
    out = kernel_attention.decode_attention(q, new_k, new_v, cache, meta, scale, window)
    torch.testing.assert_close(
        out.double(), _reference(q, ks, vs, seq_lens, scale, window), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("window", [None, 7])
def test_slot_decode_attention_matches_dense(kernel_only, threads, window) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    layout = XTensorKVLayout(resolve_platform("cpu").vmm(), max_model_len=64, slots_per_chunk=2)
    try:
        paged = layout.allocate(KVCacheSpec(1, num_kv_heads, head_dim, block_size, torch.float32), 32, "cpu")
        kv: ContiguousKV = layout.attention_caches(paged)[0]
        seq_lens = [5, 64, 17, 1, 33]  # five slots over three chunks, in batch order 0..4 reversed below
        tables = [[b * 4 + i for i in range(-(-s // block_size))] for b, s in enumerate(seq_lens)]
        slots = layout.prepare([(f"s{b}", t, n) for b, (t, n) in enumerate(zip(tables, seq_lens))])
        ks, vs, q = _decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, gen)
        ctx = build_attention_metadata(
            [s - 1 for s in seq_lens], [s - 1 for s in seq_lens], tables, block_size
        )
        store_kv(torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), paged[0], ctx.slot_mapping)
        order = [4, 2, 0, 3, 1]  # a batch order that is not slot order
        meta = build_attention_metadata(
            [1] * 5, [seq_lens[b] for b in order], [tables[b] for b in order], block_size
        )
        meta.kv_slots = [slots[b] for b in order]
        scale = head_dim**-0.5
        new_k, new_v = torch.cat([ks[b][-1:] for b in order]), torch.cat([vs[b][-1:] for b in order])
        out = kernel_attention.decode_attention_contiguous(q[order], new_k, new_v, kv, meta, scale, window)
        ref = _reference(
            q[order], [ks[b] for b in order], [vs[b] for b in order], meta.seq_lens_cpu, scale, window
        )
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    finally:
        layout.close()


def _bf16_paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed):
    """A bfloat16 paged cache (NaN where nothing was written) holding every sequence's context but its
    last token; returns the cache, the tables, the decode step's q / new K / new V (bfloat16)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 96
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan")).bfloat16()
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    ks, vs, q = (
        [t.bfloat16() for t in part] if isinstance(part, list) else part.bfloat16()
        for part in _decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, gen)
    )
    ctx = build_attention_metadata([s - 1 for s in seq_lens], [s - 1 for s in seq_lens], tables, block_size)
    store_kv(torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), cache, ctx.slot_mapping)
    return cache, tables, q, torch.cat([k[-1:] for k in ks]), torch.cat([v[-1:] for v in vs])


def _float32_reference(q, k, v, cache, seq_lens, tables, block_size, scale, window):
    """The torch reference in float32 over float32 copies of the bfloat16 inputs, rounded to bfloat16;
    and the float32 cache it wrote."""
    from ops.torch_ref.attention import attention as torch_ref_attention

    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    ref_cache = cache.float()
    out = torch_ref_attention(q.float(), k.float(), v.float(), ref_cache, meta, scale, window)
    return out.bfloat16(), ref_cache


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (16, 1, 128), (4, 2, 16), (12, 4, 48)]
)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size,seq_lens", [(16, [1, 16, 17, 40, 100, 3]), (128, [300, 129, 64, 1])])
def test_bf16_paged_decode_attention_within_one_ulp(
    kernel_only, threads, num_heads, num_kv_heads, head_dim, window, block_size, seq_lens
):
    """bfloat16 q and cache through the kernel (48: a head size with no specialised copy) against
    the float32 reference rounded to bfloat16: at most one bfloat16 ulp apart, or 1e-6 where a
    result cancels to near zero; the new K/V rows stored bit for bit."""
    cache, tables, q, new_k, new_v = _bf16_paged_case(
        seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=num_heads + head_dim
    )
    scale = head_dim**-0.5
    want, ref_cache = _float32_reference(q, new_k, new_v, cache, seq_lens, tables, block_size, scale, window)
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    out = kernel_attention.decode_attention(q, new_k, new_v, cache, meta, scale, window)
    assert_within_one_bf16_ulp(out, want, atol=1e-6)
    torch.testing.assert_close(cache.float(), ref_cache, rtol=0, atol=0, equal_nan=True)


def test_bf16_decode_attention_does_not_depend_on_the_thread_count(kernel_only) -> None:
    """One sequence (2 threads split its KV heads) and several (one task each): the same bits."""
    seq_lens, block_size = [40, 100, 3, 17], 16
    cache, tables, q, new_k, new_v = _bf16_paged_case(seq_lens, 8, 4, 64, block_size, seed=5)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for b in (slice(0, 1), slice(0, 4)):
                meta = build_attention_metadata([1] * (b.stop - b.start), seq_lens[b], tables[b], block_size)
                results.append(kernel_attention.decode_attention(q[b], new_k[b], new_v[b], cache, meta, 0.1))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])
    assert torch.equal(results[0], results[1][:1])  # a sequence's result does not depend on its batch


@pytest.fixture
def xtensor_layout():
    """An xTensor layout closed at teardown (after pytest has reported a failure: its report may
    read tensors in the layout's mappings)."""
    layout = XTensorKVLayout(resolve_platform("cpu").vmm(), max_model_len=64, slots_per_chunk=2)
    yield layout
    layout.close()


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("window", [None, 7])
def test_bf16_slot_decode_attention_within_one_ulp(kernel_only, xtensor_layout, threads, window) -> None:
    """The xTensor layout in bfloat16: each sequence's slot read in place, in a batch order that is
    not slot order, against the float32 reference over the same blocks rounded to bfloat16."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16  # a K block: one 4 KiB page
    gen = torch.Generator().manual_seed(6)
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, torch.bfloat16)
    paged = xtensor_layout.allocate(spec, 32, "cpu")
    kv: ContiguousKV = xtensor_layout.attention_caches(paged)[0]
    seq_lens = [5, 64, 17, 1, 33]
    tables = [[b * 4 + i for i in range(-(-s // block_size))] for b, s in enumerate(seq_lens)]
    slots = xtensor_layout.prepare([(f"s{b}", t, n) for b, (t, n) in enumerate(zip(tables, seq_lens))])
    ks, vs, q = _decode_inputs(seq_lens, num_heads, num_kv_heads, head_dim, gen)
    ks, vs, q = [k.bfloat16() for k in ks], [v.bfloat16() for v in vs], q.bfloat16()
    ctx = build_attention_metadata([s - 1 for s in seq_lens], [s - 1 for s in seq_lens], tables, block_size)
    store_kv(torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), paged[0], ctx.slot_mapping)
    order = [4, 2, 0, 3, 1]
    lens, order_tables = [seq_lens[b] for b in order], [tables[b] for b in order]
    meta = build_attention_metadata([1] * 5, lens, order_tables, block_size)
    meta.kv_slots = [slots[b] for b in order]
    scale = head_dim**-0.5
    new_k, new_v = torch.cat([ks[b][-1:] for b in order]), torch.cat([vs[b][-1:] for b in order])
    want, ref_cache = _float32_reference(
        q[order], new_k, new_v, paged[0], lens, order_tables, block_size, scale, window
    )
    out = kernel_attention.decode_attention_contiguous(q[order], new_k, new_v, kv, meta, scale, window)
    assert_within_one_bf16_ulp(out, want, atol=1e-6)
    written = torch.cat([ref_cache[:, blocks] for blocks in tables], dim=1)
    assert torch.equal(torch.cat([paged[0][:, blocks] for blocks in tables], dim=1).float(), written)


def test_mixed_step_decodes_run_the_kernel_beside_reference_prefills(monkeypatch) -> None:
    from ops.torch_ref.attention import attention as torch_ref_attention

    gen = torch.Generator().manual_seed(8)
    block_size, num_kv_heads, head_dim = 16, 2, 64
    query_lens, seq_lens = [1, 5, 1, 20], [30, 5, 17, 36]  # decode, prefill, decode, chunk after 16
    tables = [[0, 1], [2], [3, 4], [5, 6, 7]]
    cache = torch.randn(2, 8, block_size, num_kv_heads, head_dim, generator=gen)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(query_lens), 8, head_dim, generator=gen)
    k, v = (torch.randn(sum(query_lens), num_kv_heads, head_dim, generator=gen) for _ in range(2))
    ref_cache = cache.clone()
    ref = torch_ref_attention(
        q, k, v, ref_cache, build_attention_metadata(query_lens, seq_lens, tables, 16), 0.1
    )

    def refuse(*args, **kwargs):
        raise AssertionError("the whole step fell back to the reference")

    monkeypatch.setattr(kernel_attention, "reference_attention", refuse)
    out = kernel_attention.decode_attention(q, k, v, cache, meta, 0.1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, ref_cache)  # the new K/V were stored the same way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_writes_strided_rows_like_the_reference(monkeypatch, dtype) -> None:
    """K/V rows split out of one fused QKV output (strided views) land where ``store_kv`` puts them,
    with the C call (float32 and bfloat16 alike)."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k, v = k.view(5, num_kv_heads, head_dim), v.view(5, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    cache = torch.randn(2, 4, 16, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([3, 17, 40, 63, 0])
    ref = cache.clone()
    store_kv(k, v, ref, slots)

    def refuse(*args, **kwargs):
        raise AssertionError("the reference store ran instead of xllm_store_kv")

    monkeypatch.setattr(kernel_attention, "store_kv", refuse)
    kernel_attention._store_kv(k, v, cache, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_other_dtypes_use_the_reference(dtypes) -> None:
    """The kernel takes float32 and bfloat16 q with a cache of the same dtype: a float16 step, or
    bfloat16 q over a float32 cache, gets exactly the torch reference's output and cache."""
    from ops.torch_ref.attention import attention as torch_ref_attention

    q_dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 4, 16, 2, 64, generator=gen).to(cache_dtype)
    q = torch.randn(1, 4, 64, generator=gen).to(q_dtype)
    k, v = (torch.randn(1, 2, 64, generator=gen).to(q_dtype) for _ in range(2))
    ref_cache = cache.clone()
    ref = torch_ref_attention(q, k, v, ref_cache, build_attention_metadata([1], [5], [[0]], 16), 0.1)
    out = kernel_attention.decode_attention(
        q, k, v, cache, build_attention_metadata([1], [5], [[0]], 16), 0.1
    )
    assert out.dtype == q_dtype and torch.equal(out, ref)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_row_argmax_matches_torch_max(threads) -> None:
    from ops.cpu_kernels.reduce import row_argmax

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 1000, generator=gen)
    x[1, 10] = x[1, 500] = 100.0  # ties: the first
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 7] = x[3, 900] = float("nan")  # NaN: the first
    x[4, 999] = 50.0  # in the last partial vector
    x[5, :] = 0.0  # all equal
    x[6, 15] = float("inf")
    for rows in (x, x[:, :37], x[:, 3:], torch.randn(1, 17, generator=gen), x[:, :16]):
        assert torch.equal(row_argmax(rows), rows.max(dim=1).indices), rows.shape
    assert kernel_library("row_argmax") is not None
