"""W8A8 int8 linear layers on CUDA's int8 tensor cores, through ``torch._int_mm`` (cuBLASLt).

The arithmetic is the CPU backend's (``ops/cpu_kernels/linear_int8.py``, whose ``reference_w8a8`` is
the oracle): the weight rounded once per output channel to int8, each input row rounded per token as
it arrives, the products summed exactly in int32, both scales applied to the sums in float32, then
the bias. On a GPU the rounding of ``x`` and the scaling are Triton kernels, one launch each
(``ops/cuda_kernels/quantize.token_kernels``). ``_int_mm`` wants more than 16 rows and ``k``, ``n``
multiples of 8: the weight is padded once at load, the columns of ``x`` when ``k`` needs it, and a
step of up to 16 rows (decode) is padded to ``MIN_ROWS`` rows of zeros (written by the quantize
itself) — the GEMM streams the same weight bytes whatever the row count,
so the padding costs little where bytes bound the step (``benchmarks/cuda/quant_linear.py``).
"""

from __future__ import annotations

import torch

from ops.cuda_kernels.quantize import round_up, token_kernels
from ops.quant.int8 import int8_weight
from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

MIN_ROWS = 32  # _int_mm needs more than 16 rows; 32 keeps the padded rows a multiple of 8
DIM_MULTIPLE = 8


class W8A8Linear(QuantizedLinear):
    """A weight quantized to int8 per output channel, stored column-major ``[k, n]`` (cuBLASLt's
    int8 "TN" layout) and padded to multiples of 8; call it on ``x [..., in]`` of any float dtype:
    the output has ``x``'s dtype, or float32 with ``float_output``. With ``weight_scale [out]``,
    ``weight`` holds int8 values already (a quantized checkpoint), kept with those scales."""

    def __init__(self, weights: LinearWeights) -> None:
        super().__init__(weights)
        device = weights.weight.device
        wq, scale = int8_weight(weights)
        self.padded_in = round_up(self.in_features, DIM_MULTIPLE)
        self.padded_out = round_up(self.out_features, DIM_MULTIPLE)
        padded = torch.zeros(self.padded_out, self.padded_in, dtype=torch.int8, device=device)
        padded[: self.out_features, : self.in_features] = wq
        self.weight_t = padded.t()  # [k, n] column-major: a view, never made contiguous
        self.weight_scale = scale.to(device).contiguous()
        self.kernels = token_kernels(device)  # Triton's on a GPU, torch's on CPU tensors

    def dequantized_weight(self) -> torch.Tensor:
        """The int8 weight times its scales, ``[out, in]`` float32 (for tests)."""
        wq = self.weight_t.t()[: self.out_features, : self.in_features]
        return wq.float() * self.weight_scale[:, None]

    def forward_rows(self, flat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows = flat.shape[0]
        # q [max(rows, MIN_ROWS), padded_in]: pad columns and rows are zeros
        xq, row_scale = self.kernels.quantize(flat, torch.int8, self.padded_in, MIN_ROWS)
        acc = torch._int_mm(xq, self.weight_t)[:rows, : self.out_features]
        return self.kernels.scale(acc, row_scale[:rows], self.weight_scale, self.bias, out_dtype)
