"""The row-wise C kernels (``ops/cpu_kernels/elementwise.c``): RMSNorm with and without the residual
add, the SwiGLU gate and NeoX RoPE against float64 references, over widths that are not multiples of
16, strided rows, 1 and 2 threads (the threaded path included), batch invariance, and the reference
kept while ``torch.compile`` traces."""

from __future__ import annotations

import pytest
import torch

from ops.cpu_kernels import elementwise as kernels
from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.rope import build_cos_sin_cache
from ops.torch_ref import rope as ref_rope

pytestmark = pytest.mark.skipif(
    kernel_library("elementwise") is None,
    reason=f"CPU kernels unavailable: {unavailable_reason('elementwise')}",
)


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


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
    assert kernels_disabled_reason("panel_gemm") is None
    monkeypatch.setenv(ENV_KERNELS, "-nope")
    with pytest.raises(ValueError, match="panel_gemm"):
        kernels_disabled_reason("panel_gemm")
