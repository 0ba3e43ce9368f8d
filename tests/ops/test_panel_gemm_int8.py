"""The W8A8 int8 panel GEMM (``panel_gemm_int8.c``): per-token int8 activations times per-channel
int8 weights summed exactly, equal to the same arithmetic in torch; rows independent of their batch
and the threads; a model packed with ``quantization="w8a8"`` keeps its LM head in its dtype."""

from __future__ import annotations

import pytest
import torch

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.cpu_kernels.linear_int8 import PanelLinearInt8, quantize_rows, reference_w8a8
from ops.quant.weights import LinearWeights
from tests.ops.panel_helpers import assert_rows_independent
from xengine.layers.linear import Linear, pack_linears

pytestmark = pytest.mark.skipif(
    kernel_library("panel_gemm_int8") is None,
    reason=f"int8 panel GEMM unavailable here: {unavailable_reason('panel_gemm_int8')}",
)

SHAPES = [
    (1, 512, 1024, False),
    (5, 515, 70, True),
    (32, 512, 2816, False),
    (37, 1408, 96, True),
    (200, 64, 96, False),
]


def _lib():  # noqa: ANN202 - a ctypes.CDLL
    return kernel_library("panel_gemm_int8")


@pytest.mark.parametrize("float_output", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n", "with_bias"), SHAPES)
def test_matches_the_same_arithmetic_in_torch(
    m: int, k: int, n: int, with_bias: bool, dtype: torch.dtype, float_output: bool
) -> None:
    torch.manual_seed(m * 7 + k)
    w = torch.randn(n, k).to(dtype)
    bias = torch.randn(n) if with_bias else None
    x = torch.randn(m, k).to(dtype)
    layer = PanelLinearInt8(LinearWeights(w, bias, float_output, "w8a8"), _lib())
    out = layer(x)
    assert out.dtype == (torch.float32 if float_output else dtype)
    ref = reference_w8a8(x, w, bias)
    # the integer sums are exact: only the fp32 scaling (and a bf16 output's rounding) differ
    tol = 1e-5 if out.dtype == torch.float32 else 2**-8
    assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_weights_round_per_channel_and_dequantize() -> None:
    torch.manual_seed(1)
    w = torch.randn(70, 515) * torch.linspace(0.01, 3.0, 70)[:, None]
    w[5] = 0.0  # an all-zero channel keeps scale 1 and quantizes to zeros
    layer = PanelLinearInt8(LinearWeights(w, None, False, "w8a8"), _lib())
    q, scale = quantize_rows(w)
    torch.testing.assert_close(layer.scales, scale)
    torch.testing.assert_close(layer.dequantized_weight(), q.float() * scale[:, None])
    assert (layer.dequantized_weight() - w).abs().max(dim=1).values.le(scale / 2 + 1e-6).all()


def test_rows_do_not_depend_on_their_batch_or_the_threads() -> None:
    torch.manual_seed(3)
    w, x = torch.randn(300, 640), torch.randn(40, 640)
    assert_rows_independent(PanelLinearInt8(LinearWeights(w, None, True, "w8a8"), _lib()), x)


def test_a_w8a8_model_keeps_its_lm_head() -> None:
    torch.manual_seed(4)
    body, head = Linear(64, 48, bias=True), Linear(48, 100, bias=False)
    head.float_output = True
    model = torch.nn.Sequential(body, head)
    assert pack_linears(model, "w8a8") == 2
    assert isinstance(body._packed_owner, PanelLinearInt8)
    assert not isinstance(head._packed_owner, PanelLinearInt8)
    x = torch.randn(3, 64)
    torch.testing.assert_close(
        body(x).double(), reference_w8a8(x, body.weight, body.bias), rtol=1e-5, atol=1e-5
    )


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="int3"):
        Linear(16, 16).pack("int3")
