"""The torch references of the quantized linear layers (``ops/quant``): the shared rounding, the
checkpoint layouts they accept, and the reference backend's ``pack_linear`` running every scheme."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops.quant.int4 import dequantize_int4, int4_weight, quantize_int4
from ops.quant.int8 import quantize_int8
from ops.quant.weights import LinearWeights
from ops.torch_ref import reference_ops


def test_int4_rounds_each_group_to_its_range() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 300) * torch.linspace(0.1, 2.0, 6)[:, None]
    w[2] = 0.0  # an all-zero channel: scale 1, zero 0, codes 0
    w[3] = w[3].abs()  # all positive: 0 is kept in the range, so zero = 0 and codes up to 15
    q, scale, zero = quantize_int4(w)
    assert q.shape == w.shape and scale.shape == zero.shape == (6, 3)  # 128 + 128 + 44
    assert q.max() <= 15 and torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15
    assert (scale[2] == 1).all() and (zero[2] == 0).all() and (q[2] == 0).all() and (zero[3] == 0).all()
    err = (dequantize_int4(q, scale, zero, 128) - w).abs()
    assert (err <= scale.repeat_interleave(128, dim=1)[:, :300] / 2 + 1e-6).all()


def test_int4_checkpoints_must_divide_their_inputs_into_groups() -> None:
    with pytest.raises(ValueError, match="divide"):
        int4_weight(torch.zeros(4, 100), torch.ones(4, 3), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="weight_zero"):
        int4_weight(torch.zeros(4, 96), torch.ones(4, 3), torch.full((4, 3), 16.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_backend_runs_every_scheme(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    w, bias, x = torch.randn(40, 256), torch.randn(40), torch.randn(3, 256).to(dtype)
    pack = reference_ops()["pack_linear"]
    assert pack(LinearWeights(w, bias, False, "none")) is None
    q8, s8 = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w)
    xq, sx = quantize_int8(x.float())
    expected = {
        "int8": F.linear(x.float(), q8.float() * s8[:, None], bias),
        "int4": F.linear(x.float(), dequantize_int4(q4, s4, z4, 128), bias),
        "w8a8": (xq.double() @ q8.double().T * sx.double()[:, None] * s8.double()).float() + bias,
    }
    for scheme, want in expected.items():
        layer = pack(LinearWeights(w, bias, False, scheme))
        assert layer.out_features == 40
        got = layer(x)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want.to(dtype))
        assert pack(LinearWeights(w, bias, True, scheme))(x).dtype == torch.float32
    fp8 = pack(LinearWeights(w, bias, False, "fp8"))
    assert fp8(x).shape == (3, 40)


def test_the_reference_refuses_what_it_cannot_run() -> None:
    pack = reference_ops()["pack_linear"]
    with pytest.raises(ValueError, match="int3"):
        pack(LinearWeights(torch.zeros(4, 4), None, False, "int3"))
    with pytest.raises(ValueError, match="symmetric"):
        pack(LinearWeights(torch.zeros(4, 4), None, False, "int8", torch.ones(4), zero=torch.zeros(4, 1)))
