"""The row-wise C kernels (``ops/cpu_kernels/elementwise.c``): RMSNorm with and without the residual
add, the SwiGLU gate and NeoX RoPE against float64 references, over widths that are not multiples of
16, strided rows, 1 and 2 threads (the threaded path included), batch invariance, and the reference
kept while ``torch.compile`` traces; their bfloat16 copies against the float32 reference rounded to
bfloat16, and mixed dtypes taking the reference."""

from __future__ import annotations

import pytest
import torch

from ops.cpu_kernels import elementwise as kernels
from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.rope import build_cos_sin_cache
from ops.torch_ref import activation as ref_act
from ops.torch_ref import norm as ref_norm
from ops.torch_ref import rope as ref_rope

pytestmark = pytest.mark.skipif(
    kernel_library("elementwise") is None,
    reason=f"CPU kernels unavailable: {unavailable_reason('elementwise')}",
)


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()).float()


@pytest.mark.parametrize("rows,n", [(1, 16), (3, 33), (37, 128), (600, 100)])  # 600 x 100: threaded
def test_rms_norm_and_fused_add_match_float64(threads, rows, n) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    wide = torch.randn(rows, n + 7, generator=gen) * 3  # rows strided: a view of a wider tensor
    x, w = wide[:, :n], torch.randn(n, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), _norm64(x, w, 1e-6), rtol=2e-6, atol=2e-6)
    x = torch.randn(rows, n, generator=gen)
    residual = torch.randn(rows, n, generator=gen)
    want_sum = x + residual
    out, new_residual = kernels.fused_add_rms_norm(x, residual, w, 1e-5)
    assert new_residual.data_ptr() == x.data_ptr()  # the sum goes into x, as the reference's
    torch.testing.assert_close(new_residual, want_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, _norm64(want_sum, w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 4, 32), (9, 8, 64), (300, 4, 40)])
def test_rms_norm_of_heads_in_a_fused_projection(threads, tokens, heads, dim) -> None:
    """Qwen3's per-head q/k norm: a [T, heads, D] view whose token stride is the fused width."""
    gen = torch.Generator().manual_seed(tokens * heads)
    fused = torch.randn(tokens, (heads + 3) * dim, generator=gen)
    q = fused[:, dim : (heads + 1) * dim].view(tokens, heads, dim)
    w = torch.randn(dim, generator=gen)
    got = kernels.rms_norm(q, w, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, _norm64(q, w, 1e-6), rtol=2e-6, atol=2e-6)
    residual = torch.randn(tokens, heads, dim, generator=gen)
    want_sum = q + residual
    out, new_residual = kernels.fused_add_rms_norm(q, residual, w, 1e-6)
    assert new_residual.data_ptr() == q.data_ptr()
    torch.testing.assert_close(new_residual, want_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, _norm64(want_sum, w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 32), (5, 3, 200), (700, 2 * 96)])
def test_silu_and_mul_matches_float64(threads, shape) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 6
    x[0, ..., 0] = -120.0  # exp(-x) past float range: silu -> -0.0, not NaN
    n = shape[-1] // 2
    g, u = x[..., :n].double(), x[..., n:].double()
    want = (g * torch.sigmoid(g) * u).float()
    got = kernels.silu_and_mul(x)
    assert got.shape == (*shape[:-1], n) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,hq,hk,dim", [(1, 4, 2, 32), (9, 8, 2, 64), (700, 4, 4, 128), (3, 2, 1, 40)])
def test_rope_neox_matches_reference(threads, tokens, hq, hk, dim) -> None:
    gen = torch.Generator().manual_seed(tokens * dim)
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=gen)  # q and k: views of a fused output
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].view(tokens, hk, dim)
    cache = build_cos_sin_cache(dim, 1024, 10000.0)
    positions = torch.randint(0, 1024, (tokens,), generator=gen)
    got_q, got_k = kernels.rotary_embedding(positions.int(), q, k, cache)
    want_q, want_k = ref_rope.rotary_embedding(positions, q.double(), k.double(), cache.double())
    torch.testing.assert_close(got_q, want_q.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k.float(), rtol=1e-5, atol=1e-5)


def test_a_row_is_the_same_alone_and_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(900, 128, generator=gen), torch.randn(128, generator=gen)
    gate = torch.randn(900, 2 * 384, generator=gen)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6)[5], kernels.rms_norm(x[5:6], w, 1e-6)[0])
    assert torch.equal(kernels.silu_and_mul(gate)[7], kernels.silu_and_mul(gate[7:8])[0])


def test_traced_code_keeps_the_torch_ops() -> None:
    """Under ``torch.compile`` the reference runs (a ctypes call cannot be traced): same values."""
    x, w = torch.randn(4, 64), torch.randn(64)
    compiled = torch.compile(lambda a: kernels.silu_and_mul(kernels.rms_norm(a, w, 1e-6)), fullgraph=True)
    torch.testing.assert_close(compiled(x), kernels.silu_and_mul(kernels.rms_norm(x, w, 1e-6)))


def test_other_inputs_take_the_reference() -> None:
    x = torch.randn(3, 32, dtype=torch.float64)
    w = torch.randn(32, dtype=torch.float64)
    assert kernels.rms_norm(x, w, 1e-6).dtype == torch.float64
    q, k = torch.randn(2, 2, 32), torch.randn(2, 1, 32)
    cache = build_cos_sin_cache(16, 64, 10000.0)  # partial rotary: the reference
    got = kernels.rotary_embedding(torch.tensor([1, 2]), q, k, cache)
    want = ref_rope.rotary_embedding(torch.tensor([1, 2]), q, k, cache)
    torch.testing.assert_close(got, want)


def test_one_kernel_can_be_turned_off_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from ops.cpu_kernels.build import ENV_KERNELS, kernels_disabled_reason

    monkeypatch.setenv(ENV_KERNELS, "-elementwise,-row_argmax")
    assert "elementwise off" in kernels_disabled_reason("elementwise")
    assert kernels_disabled_reason("decode_attention") is None
    monkeypatch.setenv(ENV_KERNELS, "-nope")
    with pytest.raises(ValueError, match="panel_gemm"):
        kernels_disabled_reason("panel_gemm")


# bfloat16: each kernel against the torch reference computed in float32 from the same bfloat16 inputs,
# then rounded to bfloat16. Tolerance: at most one bfloat16 ulp apart (neighbouring values), or within
# ``atol`` where a result cancels to near zero and float32's own rounding (in a different order)
# already spans several bfloat16 ulps there.


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 bits as integers in value order (neighbouring values differ by 1; -0 == +0)."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -32768 - bits, bits)


def assert_within_one_bf16_ulp(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    ulps = (_ordered(got) - _ordered(want)).abs()
    bad = (ulps > 1) & ((got.float() - want.float()).abs() > atol)
    assert not bad.any(), f"{int(bad.sum())} values > 1 ulp apart: {got[bad][:4]} vs {want[bad][:4]}"


@pytest.fixture
def bf16_kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if an elementwise op falls back to its torch reference."""

    class Refuse:
        def __getattr__(self, name: str):
            raise AssertionError(f"the reference {name} ran instead of the kernel")

    for module in ("ref_norm", "ref_act", "ref_rope"):
        monkeypatch.setattr(kernels, module, Refuse())


def _ref_norm32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return ref_norm.rms_norm(x.float(), w.float(), eps).bfloat16()


@pytest.mark.parametrize("rows,n", [(1, 16), (3, 33), (37, 128), (600, 100), (4, 1000)])
def test_bf16_rms_norm_and_fused_add_within_one_ulp(bf16_kernel_only, threads, rows, n) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    wide = (torch.randn(rows, n + 7, generator=gen) * 3).bfloat16()  # strided rows
    x, w = wide[:, :n], torch.randn(n, generator=gen).bfloat16()
    got = kernels.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    assert_within_one_bf16_ulp(got, _ref_norm32(x, w, 1e-6))
    x, residual = (torch.randn(rows, n, generator=gen).bfloat16() for _ in range(2))
    want_sum = x + residual  # torch's bfloat16 add: float32 sum, rounded once
    out, new_residual = kernels.fused_add_rms_norm(x, residual, w, 1e-5)
    assert new_residual.data_ptr() == x.data_ptr() and new_residual.dtype == torch.bfloat16
    assert torch.equal(new_residual.view(torch.int16), want_sum.view(torch.int16))
    assert_within_one_bf16_ulp(out, _ref_norm32(want_sum, w, 1e-5))


def test_bf16_rms_norm_of_heads_in_a_fused_projection(bf16_kernel_only, threads) -> None:
    tokens, heads, dim = 9, 8, 64
    gen = torch.Generator().manual_seed(9)
    fused = torch.randn(tokens, (heads + 3) * dim, generator=gen).bfloat16()
    q = fused[:, dim : (heads + 1) * dim].view(tokens, heads, dim)
    w = torch.randn(dim, generator=gen).bfloat16()
    assert_within_one_bf16_ulp(kernels.rms_norm(q, w, 1e-6), _ref_norm32(q, w, 1e-6))
    residual = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    want_sum = q + residual
    out, new_residual = kernels.fused_add_rms_norm(q, residual, w, 1e-6)
    assert torch.equal(new_residual.view(torch.int16), want_sum.view(torch.int16))
    assert_within_one_bf16_ulp(out, _ref_norm32(want_sum, w, 1e-6))


@pytest.mark.parametrize("shape", [(1, 32), (5, 3, 200), (700, 2 * 96), (3, 2 * 1000)])
def test_bf16_silu_and_mul_within_one_ulp(bf16_kernel_only, threads, shape) -> None:
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 6).bfloat16()
    x[0, ..., 0] = -120.0  # exp's input is clamped at -87: silu(-120) * u is about 1e-36, not 0
    got = kernels.silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], shape[-1] // 2)
    assert_within_one_bf16_ulp(got, ref_act.silu_and_mul(x.float()).bfloat16(), atol=1e-30)


def test_bf16_stores_round_to_nearest_even_like_torch(bf16_kernel_only) -> None:
    """silu(g) is exactly g for g >= 20 and g * u of two bfloat16 values is exact in float32, so the
    gate's output is that product rounded once: bit for bit torch's conversion, ties (about one in 256
    here) and infinities included, in full vectors and tails. NaN becomes the quiet NaN 0x7fc0 (as
    ``c10::BFloat16``; torch's vectorised conversion writes 0xffff)."""
    gen = torch.Generator().manual_seed(11)
    g = (20 + torch.rand(64, 37, generator=gen) * 60).bfloat16()
    u = (torch.randn(64, 37, generator=gen) * 100).bfloat16()
    u[3, 5], u[4, 36], u[5, 0] = float("nan"), float("inf"), float("-inf")
    got = kernels.silu_and_mul(torch.cat([g, u], dim=-1))
    want = (g.float() * u.float()).bfloat16()
    exact = (g.float() * u.float()) == want.float()
    assert (~exact).sum() > 1000  # most products do round
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and (got.view(torch.int16)[nan] == 0x7FC0).all()
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("tokens,hq,hk,dim", [(1, 4, 2, 32), (9, 8, 2, 64), (700, 4, 4, 128), (3, 2, 1, 40)])
def test_bf16_rope_neox_within_one_ulp(bf16_kernel_only, threads, tokens, hq, hk, dim) -> None:
    """bfloat16 q and k, the model's float32 cos/sin cache (``RotaryEmbedding`` keeps it float32)."""
    gen = torch.Generator().manual_seed(tokens * dim)
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=gen).bfloat16()
    q = qkv[:, : hq * dim].view(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].view(tokens, hk, dim)
    cache = build_cos_sin_cache(dim, 1024, 10000.0)
    positions = torch.randint(0, 1024, (tokens,), generator=gen)
    got_q, got_k = kernels.rotary_embedding(positions, q, k, cache)
    want_q, want_k = ref_rope.rotary_embedding(positions, q.float(), k.float(), cache)
    assert_within_one_bf16_ulp(got_q, want_q.bfloat16(), atol=1e-6)
    assert_within_one_bf16_ulp(got_k, want_k.bfloat16(), atol=1e-6)


def test_bf16_results_do_not_depend_on_the_thread_count(bf16_kernel_only) -> None:
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(600, 100, generator=gen).bfloat16(), torch.randn(100, generator=gen).bfloat16()
    gate = torch.randn(600, 2 * 100, generator=gen).bfloat16()
    q, k = (
        torch.randn(700, 4, 64, generator=gen).bfloat16(),
        torch.randn(700, 2, 64, generator=gen).bfloat16(),
    )
    cache, positions = build_cos_sin_cache(64, 1024, 10000.0), torch.randint(0, 1024, (700,), generator=gen)

    def run() -> list[torch.Tensor]:
        x2 = x.clone()
        out, new_residual = kernels.fused_add_rms_norm(x2, x, w, 1e-6)
        rope = kernels.rotary_embedding(positions, q, k, cache)
        return [kernels.rms_norm(x, w, 1e-6), out, new_residual, kernels.silu_and_mul(gate), *rope]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(one, two))


def test_bf16_nan_stays_nan(bf16_kernel_only) -> None:
    x, w = torch.randn(2, 40).bfloat16(), torch.randn(40).bfloat16()
    x[0, 37] = float("nan")  # in the tail
    out = kernels.rms_norm(x, w, 1e-6)
    assert out[0].isnan().all() and not out[1].isnan().any()


def test_dtype_dispatch_kernels_for_one_dtype_reference_for_mixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and bfloat16 calls (RoPE's cache float32) take the kernels; a bfloat16 activation with
    a float32 weight or residual, a bfloat16 cos/sin cache and float16 take the reference, with its
    results (a float32 weight: its float32 promotion)."""
    ran: list[str] = []

    class Counted:
        def __init__(self, module) -> None:  # noqa: ANN001
            self.module = module

        def __getattr__(self, name: str):  # noqa: ANN204
            ran.append(name)
            return getattr(self.module, name)

    for name, module in (("ref_norm", ref_norm), ("ref_act", ref_act), ("ref_rope", ref_rope)):
        monkeypatch.setattr(kernels, name, Counted(module))

    def takes_reference(fn, *args) -> bool:  # noqa: ANN001
        ran.clear()
        fn(*args)
        return bool(ran)

    gen = torch.Generator().manual_seed(13)
    x, res, w = (
        torch.randn(3, 32, generator=gen),
        torch.randn(3, 32, generator=gen),
        torch.randn(32, generator=gen),
    )
    q, k = torch.randn(2, 2, 32, generator=gen), torch.randn(2, 1, 32, generator=gen)
    cache, pos = build_cos_sin_cache(32, 64, 10000.0), torch.tensor([1, 2])
    b = torch.bfloat16
    for dtype in (torch.float32, b):
        assert not takes_reference(kernels.rms_norm, x.to(dtype), w.to(dtype), 1e-6)
        assert not takes_reference(kernels.fused_add_rms_norm, x.to(dtype), res.to(dtype), w.to(dtype), 1e-6)
        assert not takes_reference(kernels.silu_and_mul, x.to(dtype))
        assert not takes_reference(kernels.rotary_embedding, pos, q.to(dtype), k.to(dtype), cache)
    assert takes_reference(kernels.rms_norm, x.to(b), w, 1e-6)
    assert takes_reference(kernels.fused_add_rms_norm, x.to(b), res, w.to(b), 1e-6)
    assert takes_reference(kernels.rotary_embedding, pos, q.to(b), k.to(b), cache.to(b))
    assert takes_reference(kernels.silu_and_mul, x.half())
    got = kernels.rms_norm(x.to(b), w, 1e-6)
    assert got.dtype == torch.float32 and torch.equal(got, ref_norm.rms_norm(x.to(b), w, 1e-6))
