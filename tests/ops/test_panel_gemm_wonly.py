"""The weight-only int8 / int4 panel GEMM (``panel_gemm_wonly.h``): equal to its torch reference
(``ops/quant``: dequantize and compute) for every row count, shape, group size, input dtype and output
kind; a row's result independent of its batch and the threads (bit for bit, across the kernel's
one-row-block and shared-chunk paths); a quantized checkpoint's codes packed as they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.cpu_kernels.linear_wonly import PanelLinearWeightOnly
from ops.quant.int4 import ReferenceInt4Linear, quantize_int4
from ops.quant.int8 import ReferenceInt8Linear
from ops.quant.weights import LinearWeights
from tests.ops.panel_helpers import assert_rows_independent
from xengine.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    kernel_library("panel_gemm_wonly") is None,
    reason=f"weight-only panel GEMM unavailable here: {unavailable_reason('panel_gemm_wonly')}",
)

# rows, in, out, int4 group (None: on the fly, groups of 128), bias
SHAPES = [
    (1, 512, 1024, None, False),
    (3, 515, 70, None, True),
    (32, 512, 300, 64, False),
    (300, 256, 96, 32, True),
    (37, 1408, 45, 128, True),
]


def _libs() -> tuple:
    return kernel_library("panel_gemm_wonly"), kernel_library("panel_gemm_wonly_bf16")


def _layers(bits: int, w: torch.Tensor, bias: torch.Tensor | None, group: int | None, float_output: bool):
    """The kernel's layer and the reference, from the dense weight or (``group``) checkpoint codes."""
    if bits == 8:
        return PanelLinearWeightOnly(
            LinearWeights(w, bias, float_output, "int8"), _libs()
        ), ReferenceInt8Linear(LinearWeights(w, bias, float_output, "int8"))
    if group is None:
        return PanelLinearWeightOnly(
            LinearWeights(w, bias, float_output, "int4"), _libs()
        ), ReferenceInt4Linear(LinearWeights(w, bias, float_output, "int4"))
    q, scale, zero = quantize_int4(w, group)
    kernel = PanelLinearWeightOnly(LinearWeights(q.float(), bias, float_output, "int4", scale, zero), _libs())
    return kernel, ReferenceInt4Linear(LinearWeights(q.float(), bias, float_output, "int4", scale, zero))


@pytest.mark.parametrize("float_output", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("m", "k", "n", "group", "with_bias"), SHAPES)
def test_matches_the_reference(
    m: int,
    k: int,
    n: int,
    group: int | None,
    with_bias: bool,
    bits: int,
    dtype: torch.dtype,
    float_output: bool,
) -> None:
    torch.manual_seed(m * 7 + k + bits)
    w = torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    layer, reference = _layers(bits, w, bias, group, float_output)
    assert torch.equal(layer.dequantized_weight(), reference.dequantized_weight())
    x = torch.randn(m, k).to(dtype)
    out = layer(x)
    assert out.dtype == (torch.float32 if float_output else dtype) and out.shape == (m, n)
    # the reference in float32 before any rounding of the output: the weights are exact integers in
    # the kernel, so only the order of the float32 sums (and a bf16 output's rounding) differ
    ref = F.linear(x.float(), reference.dequantized_weight(), reference.bias)
    tol = 2e-6 if out.dtype == torch.float32 else 2**-8
    assert (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_rows_do_not_depend_on_their_batch_or_the_threads(bits: int, dtype: torch.dtype) -> None:
    """40 rows share each dequantized chunk; one row alone decodes its own weights: same bits."""
    torch.manual_seed(3)
    w, x = torch.randn(300, 640), torch.randn(40, 640).to(dtype)
    assert_rows_independent(PanelLinearWeightOnly(LinearWeights(w, None, True, f"int{bits}"), _libs()), x)


def test_int4_checkpoint_codes_run_as_quantizing_on_the_fly() -> None:
    torch.manual_seed(5)
    w, x = torch.randn(96, 384), torch.randn(5, 384)
    q, scale, zero = quantize_int4(w)
    stored = PanelLinearWeightOnly(LinearWeights(q.float(), None, False, "int4", scale, zero), _libs())
    assert torch.equal(stored(x), PanelLinearWeightOnly(LinearWeights(w, None, False, "int4"), _libs())(x))


def test_a_linear_packs_a_checkpoints_scales_and_zeros() -> None:
    """``Linear.pack`` hands the loader's ``weight_scale`` and ``weight_zero`` on to the kernel."""
    torch.manual_seed(6)
    layer = Linear(256, 64, bias=False)
    q, scale, zero = quantize_int4(layer.weight.detach(), 64)
    with torch.no_grad():
        layer.weight.copy_(q.float())
    layer.weight_scale, layer.weight_zero = scale, zero
    assert layer.pack("int4")
    assert isinstance(layer._packed_owner, PanelLinearWeightOnly) and layer._packed_owner.group_size == 64
    x = torch.randn(3, 256)
    torch.testing.assert_close(
        layer(x), ReferenceInt4Linear(LinearWeights(q.float(), None, False, "int4", scale, zero))(x)
    )


def test_odd_int4_groups_are_refused() -> None:
    w = torch.randint(0, 16, (32, 99)).float()
    with pytest.raises(ValueError, match="even"):
        PanelLinearWeightOnly(
            LinearWeights(w, None, False, "int4", torch.ones(32, 3), torch.zeros(32, 3)), _libs()
        )
