"""The bf16 panel GEMM (``panel_gemm_bf16.c``): products of bf16 values summed in fp32, the same
result for a row whatever its batch or the thread count, and a bf16 model's layers packed on it."""

from __future__ import annotations

import pytest
import torch

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.cpu_kernels.linear import PanelLinearBF16
from tests.ops.panel_helpers import assert_rows_independent
from xengine.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    kernel_library("panel_gemm_bf16") is None,
    reason=f"bf16 panel GEMM unavailable here: {unavailable_reason('panel_gemm_bf16')}",
)

SHAPES = [
    (1, 512, 1024, False),
    (5, 513, 70, True),
    (32, 512, 2816, False),
    (37, 1408, 96, True),
    (200, 64, 96, False),
]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same arithmetic in float64: bf16-rounded inputs, exact products, bias added after."""
    out = x.bfloat16().double() @ w.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("float_output", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n", "with_bias"), SHAPES)
def test_matches_the_same_arithmetic_in_float64(
    m: int, k: int, n: int, with_bias: bool, x_dtype: torch.dtype, float_output: bool
) -> None:
    torch.manual_seed(m * 7 + k)
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n) if with_bias else None
    x = torch.randn(m, k).to(x_dtype)
    layer = PanelLinearBF16(w, bias, kernel_library("panel_gemm_bf16"), float_output)
    out = layer(x)
    assert out.dtype == (torch.float32 if float_output else x_dtype)
    ref = _reference(x, w, bias)
    # fp32 accumulation over k terms; a bf16 output adds one rounding (2^-8 relative)
    tol = 1e-5 if out.dtype == torch.float32 else 2**-8
    assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_rows_do_not_depend_on_their_batch_or_the_threads() -> None:
    torch.manual_seed(3)
    w, x = torch.randn(300, 640).bfloat16(), torch.randn(40, 640).bfloat16()
    assert_rows_independent(PanelLinearBF16(w, None, kernel_library("panel_gemm_bf16"), True), x)


def test_a_bf16_layer_packs_on_the_kernel_and_keeps_its_shape() -> None:
    torch.manual_seed(4)
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert layer.pack()
    out = layer(x)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())
