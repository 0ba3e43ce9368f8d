"""The recurrent-scan C kernel (``ops/cpu_kernels/recurrent_scan.c``): the gated delta rule and the SSD
scan against their torch references over grouped heads, head sizes that are not multiples of 16, decode
batches and long segments, 1 and 2 threads; the state carried across a cut; the caller's state left
untouched; bfloat16 inputs; the registry picking the kernel on CPU and the reference while tracing."""

from __future__ import annotations

import pytest
import torch

from ops.cpu_kernels import recurrent as kernels
from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.registry import get_op
from ops.torch_ref import gated_delta_rule as ref_gdn
from ops.torch_ref import ssd as ref_ssd

pytestmark = pytest.mark.skipif(
    kernel_library("recurrent_scan") is None,
    reason=f"CPU kernels unavailable: {unavailable_reason('recurrent_scan')}",
)


def _gdn_inputs(bsz: int, length: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, length, hk, dk, generator=gen)
    k = torch.randn(bsz, length, hk, dk, generator=gen)
    v = torch.randn(bsz, length, hv, dv, generator=gen)
    g = -torch.rand(bsz, length, hv, generator=gen) * 0.5
    beta = torch.rand(bsz, length, hv, generator=gen)
    state = torch.randn(bsz, hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _ssd_inputs(bsz: int, length: int, heads: int, p: int, groups: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, length, heads, p, generator=gen)
    dt = torch.rand(bsz, length, heads, generator=gen) * 0.2
    a = -torch.rand(heads, generator=gen) - 0.1
    b = torch.randn(bsz, length, groups, n, generator=gen)
    c = torch.randn(bsz, length, groups, n, generator=gen)
    d = torch.randn(heads, generator=gen)
    state = torch.randn(bsz, heads, p, n, generator=gen) * 0.1
    return x, dt, a, b, c, d, state


GDN_SHAPES = [  # bsz, length, hk, hv, dk, dv
    (1, 1, 2, 4, 32, 32),
    (8, 1, 2, 4, 32, 32),
    (3, 2, 1, 3, 24, 20),
    (1, 100, 2, 4, 32, 32),
    (2, 70, 2, 2, 17, 33),
    (1, 130, 4, 8, 64, 64),
]


@pytest.mark.parametrize("shape", GDN_SHAPES)
@pytest.mark.parametrize("l2norm", [True, False])
def test_gated_delta_matches_the_reference(threads, shape, l2norm) -> None:
    q, k, v, g, beta, state = _gdn_inputs(*shape)
    if not l2norm:  # unnormalised keys: keep the recurrence contractive
        q, k = q * 0.1, k * 0.1
    before = state.clone()
    out, new = kernels.gated_delta_rule(q, k, v, g, beta, state, None, l2norm)
    ref_out, ref_new = ref_gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state, None, l2norm)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(new, ref_new, atol=2e-5, rtol=1e-4)
    assert torch.equal(state, before)  # the starting state is the caller's, untouched


def test_gated_delta_explicit_scale_and_chunked_reference() -> None:
    q, k, v, g, beta, state = _gdn_inputs(2, 150, 2, 4, 32, 16, seed=3)
    out, new = kernels.gated_delta_rule(q, k, v, g, beta, state, 0.3)
    ref_out, ref_new = ref_gdn.chunked_gated_delta_rule(q, k, v, g, beta, state, 0.3)
    torch.testing.assert_close(out, ref_out, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(new, ref_new, atol=5e-5, rtol=1e-4)


def test_gated_delta_cut_anywhere_carries_the_state() -> None:
    q, k, v, g, beta, state = _gdn_inputs(1, 90, 2, 4, 32, 32, seed=5)
    whole, end = kernels.gated_delta_rule(q, k, v, g, beta, state)
    first, mid = kernels.gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    second, end2 = kernels.gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], mid)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(end2, end, atol=1e-6, rtol=1e-6)


SSD_SHAPES = [  # bsz, length, heads, p, groups, n
    (1, 1, 8, 32, 2, 16),
    (8, 1, 8, 32, 2, 16),
    (1, 100, 8, 32, 2, 16),
    (2, 70, 6, 17, 3, 9),
    (1, 130, 16, 64, 4, 64),
]


@pytest.mark.parametrize("shape", SSD_SHAPES)
@pytest.mark.parametrize("skip", [True, False])
def test_ssd_matches_the_reference(threads, shape, skip) -> None:
    x, dt, a, b, c, d, state = _ssd_inputs(*shape)
    d = d if skip else None
    before = state.clone()
    y, new = kernels.ssd_scan(x, dt, a, b, c, d, state)
    ref_y, ref_new = ref_ssd.ssd_scan(x, dt, a, b, c, d, state)
    torch.testing.assert_close(y, ref_y, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(new, ref_new, atol=5e-5, rtol=1e-4)
    assert torch.equal(state, before)


def test_ssd_cut_anywhere_carries_the_state() -> None:
    x, dt, a, b, c, d, state = _ssd_inputs(1, 90, 8, 32, 2, 16, seed=7)
    whole, end = kernels.ssd_scan(x, dt, a, b, c, d, state)
    first, mid = kernels.ssd_scan(x[:, :41], dt[:, :41], a, b[:, :41], c[:, :41], d, state)
    second, end2 = kernels.ssd_scan(x[:, 41:], dt[:, 41:], a, b[:, 41:], c[:, 41:], d, mid)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(end2, end, atol=1e-6, rtol=1e-6)


def test_bfloat16_inputs_give_bfloat16_outputs_and_a_float32_state() -> None:
    q, k, v, g, beta, state = _gdn_inputs(2, 20, 2, 4, 32, 32, seed=9)
    out, new = kernels.gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, state)
    ref_out, ref_new = ref_gdn.gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, state)
    assert out.dtype == torch.bfloat16 and new.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(new, ref_new, atol=1e-4, rtol=1e-4)
    x, dt, a, b, c, d, s = _ssd_inputs(2, 20, 8, 32, 2, 16, seed=9)
    y, new = kernels.ssd_scan(x.bfloat16(), dt, a, b.bfloat16(), c.bfloat16(), d, s)
    ref_y, ref_new = ref_ssd.ssd_scan(x.bfloat16(), dt, a, b.bfloat16(), c.bfloat16(), d, s)
    assert y.dtype == torch.bfloat16 and new.dtype == torch.float32
    torch.testing.assert_close(y.float(), ref_y.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(new, ref_new, atol=1e-4, rtol=1e-4)


def test_the_cpu_platform_runs_the_kernels() -> None:
    assert get_op("gated_delta_rule", "cpu") is kernels.gated_delta_rule
    assert get_op("ssd_scan", "cpu") is kernels.ssd_scan


def test_tracing_runs_the_reference(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(ref_gdn, "gated_delta_rule", lambda *a: calls.append("gdn") or (a[2], a[5]))
    monkeypatch.setattr(ref_ssd, "ssd_scan", lambda *a: calls.append("ssd") or (a[0], a[6]))
    kernels.gated_delta_rule(*_gdn_inputs(1, 3, 1, 1, 8, 8))
    kernels.ssd_scan(*_ssd_inputs(1, 3, 2, 8, 1, 4))
    assert calls == ["gdn", "ssd"]
