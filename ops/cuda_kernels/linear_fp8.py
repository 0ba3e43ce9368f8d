"""FP8 (e4m3) linear layers on CUDA's fp8 tensor cores (sm89 and newer), through ``torch._scaled_mm``.

The arithmetic is ``ops/quant/fp8.py``'s (``ReferenceFP8Linear``, the oracle): the weight rounded once
per output channel to e4m3, each input row per token as it arrives, float32 accumulation, both scales
on the sums, then the bias. On sm90+ a bfloat16 output takes the row-wise scaled GEMM, which applies
the scales and the bias in its epilogue; other outputs (float32, float16) and sm89 run the GEMM with
unit scales into float32 and scale after. On a GPU the rounding of ``x`` and that scaling are
Triton kernels (``ops/cuda_kernels/quantize.token_kernels``). ``_scaled_mm`` wants ``k`` and ``n``
multiples of 16: the weight is padded once at load, the columns of ``x`` when ``k`` needs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.cuda_kernels.quantize import round_up, token_kernels
from ops.quant.fp8 import E4M3, fp8_weight
from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

DIM_MULTIPLE = 16


class FP8Linear(QuantizedLinear):
    """A weight in e4m3 per output channel, stored column-major ``[k, n]`` and padded to multiples of
    16; call it on ``x [..., in]`` of any float dtype: the output has ``x``'s dtype, or float32 with
    ``float_output``. ``rowwise``: the device runs ``_scaled_mm``'s row-wise scaling (sm90+). With
    ``weights.scale [out]``, ``weight`` holds e4m3 values already (a quantized checkpoint)."""

    def __init__(self, weights: LinearWeights, rowwise: bool = True) -> None:
        super().__init__(weights)
        wq, scale = fp8_weight(weights)
        self.padded_in = round_up(self.in_features, DIM_MULTIPLE)
        self.padded_out = round_up(self.out_features, DIM_MULTIPLE)
        pad = (0, self.padded_in - self.in_features, 0, self.padded_out - self.out_features)
        self.weight_t = F.pad(wq.float(), pad).to(E4M3).t()  # [k, n] column-major (exact: e4m3 values)
        device = weights.weight.device
        self.weight_scale = scale.to(device).contiguous()
        self.rowwise = rowwise
        self.kernels = token_kernels(device)  # Triton's on a GPU, torch's on CPU tensors
        # row-wise GEMM operands: scales [1, n_pad] (1 in the padding), bias in bf16 [n_pad]
        self._col_scale = F.pad(self.weight_scale, (0, self.padded_out - self.out_features), value=1.0)
        self._col_scale = self._col_scale.view(1, -1).contiguous()
        self._bias_bf16 = None
        if self.bias is not None:
            self._bias_bf16 = F.pad(self.bias, (0, self.padded_out - self.out_features)).to(torch.bfloat16)
        self._one = torch.ones((), dtype=torch.float32, device=device)

    def dequantized_weight(self) -> torch.Tensor:
        """The e4m3 weight times its scales, ``[out, in]`` float32 (for tests)."""
        wq = self.weight_t.t()[: self.out_features, : self.in_features]
        return wq.float() * self.weight_scale[:, None]

    def forward_rows(self, flat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xq, row_scale = self.kernels.quantize(flat, E4M3, self.padded_in)  # pad columns are zeros
        if self.rowwise and out_dtype == torch.bfloat16:
            out = torch._scaled_mm(
                xq, self.weight_t, scale_a=row_scale, scale_b=self._col_scale, bias=self._bias_bf16,
                out_dtype=torch.bfloat16,
            )  # fmt: skip
            if self.padded_out != self.out_features:
                out = out[:, : self.out_features].contiguous()
            return out
        acc = torch._scaled_mm(
            xq, self.weight_t, scale_a=self._one, scale_b=self._one, out_dtype=torch.float32
        )
        return self.kernels.scale(
            acc[:, : self.out_features], row_scale, self.weight_scale, self.bias, out_dtype
        )
