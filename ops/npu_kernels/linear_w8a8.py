"""W8A8 int8 linear layers on the Ascend NPU (910B), through ``torch_npu``'s documented operators.

The arithmetic is the CPU backend's (``ops/cpu_kernels/linear_int8.reference_w8a8``): the weight
rounded once per output channel to int8 (symmetric), each input row rounded per token as it arrives
(``torch_npu.npu_dynamic_quant``: ``scale = rowmax(|x|) / 127``, ``y = round(x / scale)``), and
``torch_npu.npu_quant_matmul(x1 int8 [m, k], x2 int8 [k, n], scale float32 [n], pertoken_scale
float32 [m], bias float32 [n], output_dtype bf16 | fp16)``: int32 sums, both scales and the bias in
its epilogue. ``npu_dynamic_quant`` takes fp16/bf16 rows only: float32 rows are quantized in torch with
the same rounding, and the GEMM then writes bf16 (float32 comes from it, as ``float_output`` asks).
The weight is kept ND ``[k, n]``; the FRACTAL_NZ layout (``npu_format_cast``) is a later speed-up.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from ops.quant.int8 import int8_weight
from ops.quant.int8 import quantize_int8 as quantize_rows
from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

_NPU_ROW_DTYPES = (torch.float16, torch.bfloat16)  # what npu_dynamic_quant accepts


def _torch_npu() -> Any:
    return importlib.import_module("torch_npu")


def pack_linear(weights: LinearWeights) -> Any:
    """The NPU packed form of a linear layer: None for "none" (``F.linear``), ``NpuW8A8Linear`` for
    "w8a8" (``ValueError`` without ``torch_npu``), the reference backend's for other schemes."""
    w = weights
    if w.quantization != "w8a8":
        from ops.torch_ref import pack_linear as reference_pack

        return reference_pack(w)
    w.check_symmetric()
    if importlib.util.find_spec("torch_npu") is None:
        raise ValueError("--quantization w8a8 on the NPU needs torch_npu (and CANN), not installed here")
    return NpuW8A8Linear(w)


class NpuW8A8Linear(QuantizedLinear):
    """A weight quantized to int8 per output channel, stored ``[k, n]`` (``npu_quant_matmul``'s
    ``x2``); call it on ``x [..., in]``: the output has ``x``'s dtype, or float32 with
    ``float_output``. With ``weights.scale [out]``, ``weight`` holds int8 values already."""

    def __init__(self, weights: LinearWeights) -> None:
        super().__init__(weights)
        device = weights.weight.device
        wq, scale = int8_weight(weights)
        self.weight_kn = wq.to(device).t().contiguous()
        self.weight_scale = scale.to(device).contiguous()

    def forward_rows(self, flat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        npu = _torch_npu()
        if flat.dtype in _NPU_ROW_DTYPES:
            xq, row_scale = npu.npu_dynamic_quant(flat)  # int8 [m, k], float32 [m]
        else:
            xq, row_scale = quantize_rows(flat)
        gemm_dtype = torch.float16 if flat.dtype == torch.float16 else torch.bfloat16
        return npu.npu_quant_matmul(
            xq, self.weight_kn, self.weight_scale, pertoken_scale=row_scale, bias=self.bias,
            output_dtype=gemm_dtype,
        )  # fmt: skip
