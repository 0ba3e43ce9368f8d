"""The NPU backend's W8A8 linear layers (``ops/npu_kernels``) without an NPU: the package imports
without ``torch_npu``, registers ``pack_linear`` for "npu", refuses w8a8 where ``torch_npu`` is
missing, and drives ``torch_npu``'s two operators as documented. ``FakeTorchNpu`` is a stand-in for
``torch_npu`` (an accelerator's library this machine cannot have): it checks the documented argument
types and shapes of ``npu_dynamic_quant`` / ``npu_quant_matmul`` and computes their documented
formulas in torch, so the layer's output can be held against ``reference_w8a8``."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from ops.cpu_kernels.linear_int8 import reference_w8a8
from ops.quant.weights import LinearWeights


class FakeTorchNpu(types.ModuleType):
    """Stand-in for ``torch_npu`` (no NPU here): the two documented operators, checked and computed."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[str] = []

    def npu_dynamic_quant(self, x: torch.Tensor, *, smooth_scales=None, dst_type=torch.int8):
        assert x.dtype in (torch.float16, torch.bfloat16) and x.dim() > 1 and smooth_scales is None
        self.calls.append("npu_dynamic_quant")
        xf = x.float()
        scale = xf.abs().amax(dim=-1) / 127.0  # scale = rowMax(|x|) / 127, y = round(x / scale)
        return torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8), scale

    def npu_quant_matmul(
        self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None
    ):
        m, k = x1.shape
        assert x1.dtype == x2.dtype == torch.int8 and x2.shape[0] == k and offset is None
        n = x2.shape[1]
        assert scale.dtype == torch.float32 and scale.shape == (n,)
        assert pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (m,)
        assert bias is None or (bias.dtype == torch.float32 and bias.shape == (n,))
        assert output_dtype in (torch.bfloat16, torch.float16)
        self.calls.append("npu_quant_matmul")
        acc = (x1.double() @ x2.double()) * pertoken_scale.double()[:, None] * scale.double()
        return (acc if bias is None else acc + bias.double()).to(output_dtype)


def test_package_imports_without_torch_npu() -> None:
    import ops.npu_kernels
    import ops.npu_kernels.linear_w8a8  # noqa: F401

    assert "torch_npu" not in sys.modules


def test_npu_registers_its_pack_linear() -> None:
    from ops.npu_kernels import linear_w8a8
    from ops.registry import get_op

    assert get_op("pack_linear", "npu") is linear_w8a8.pack_linear


def test_w8a8_is_refused_without_torch_npu() -> None:
    from ops.npu_kernels.linear_w8a8 import pack_linear

    w = torch.randn(16, 32)
    assert pack_linear(LinearWeights(w, None, False, "none")) is None
    with pytest.raises(ValueError, match="--quantization w8a8 on the NPU needs torch_npu"):
        pack_linear(LinearWeights(w, None, False, "w8a8"))
    with pytest.raises(ValueError, match="zero point"):
        pack_linear(LinearWeights(w, None, False, "w8a8", zero=torch.zeros(16)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("float_output", [False, True])
def test_w8a8_drives_torch_npu_as_documented(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, float_output: bool
) -> None:
    from ops.npu_kernels.linear_w8a8 import NpuW8A8Linear

    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(2, 5, 64, generator=g),
        torch.randn(40, 64, generator=g),
        torch.randn(40, generator=g),
    )
    layer = NpuW8A8Linear(LinearWeights(w.to(dtype), b.to(dtype), float_output, "w8a8"))
    assert layer.weight_kn.shape == (64, 40) and layer.weight_kn.dtype == torch.int8
    got = layer(x.to(dtype))
    assert got.shape == (2, 5, 40) and got.dtype == (torch.float32 if float_output else dtype)
    want = reference_w8a8(x.to(dtype), w.to(dtype), b.to(dtype))
    assert (got.double() - want).abs().max().item() <= 1e-2 * want.abs().max().item()  # 16-bit GEMM output
    quantized_by = "npu_dynamic_quant" if dtype != torch.float32 else "npu_quant_matmul"
    assert fake.calls[0] == quantized_by and fake.calls[-1] == "npu_quant_matmul"
