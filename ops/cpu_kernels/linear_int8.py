"""W8A8 int8 linear layers on the int8 panel GEMM (``panel_gemm_int8.c``, AVX512_VNNI).

The weight is rounded once, per output channel, to int8 (symmetric: scale ``max |w| / 127``); each
input row is rounded to int8 per token inside the kernel as it is packed (dynamic, symmetric), the
products are summed exactly in int32, and the two scales applied to the sum. ``reference_w8a8`` is the
same arithmetic in torch (float64 sums), the oracle of the tests and of ``benchmarks/dtype_accuracy``.
"""

from __future__ import annotations

import ctypes

import torch

from ops.cpu_kernels.mixed_gemm import mixed_gemm
from ops.quant.int8 import QMAX, checked_int8
from ops.quant.int8 import quantize_int8 as quantize_rows  # the one int8 rounding (xllm model quantize too)
from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

__all__ = ["QMAX", "PanelLinearInt8", "checked_int8", "pack_quantized", "quantize_rows", "reference_w8a8"]

PANEL_COLUMNS = 32


def reference_w8a8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64: per-token int8 ``x`` times per-channel int8 ``weight``."""
    flat = x.reshape(-1, x.shape[-1]).float()
    xq, sx = quantize_rows(flat)
    wq, sw = quantize_rows(weight)
    out = (xq.double() @ wq.double().T) * sx.double()[:, None] * sw.double()[None, :]
    if bias is not None:
        out = out + bias.double()
    return out.view(*x.shape[:-1], weight.shape[0])


def pack_quantized(wq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``wq [n, k]`` in the kernel's panels ``[ceil(n / 32)][ceil(k / 4)][32][4]`` (zero padded),
    and 128 x its column sums ``[ceil(n / 32) * 32]`` int32: what ``xllm_panel_pack_int8`` writes."""
    n, k = wq.shape
    panels, quads = -(-n // PANEL_COLUMNS), -(-k // 4)
    padded = torch.zeros(panels * PANEL_COLUMNS, quads * 4, dtype=torch.int8)
    padded[:n, :k] = wq
    packed = padded.view(panels, PANEL_COLUMNS, quads, 4).permute(0, 2, 1, 3).contiguous().view(-1)
    return packed, padded.sum(dim=1, dtype=torch.int32) * 128


class PanelLinearInt8(QuantizedLinear):
    """A weight quantized to int8 per output channel and packed in 32-column panels of k quads; call
    it on ``x [..., in]`` (float32 or bfloat16: the output has its dtype, or float32 with
    ``float_output``). Other input dtypes run ``F.linear`` on the dequantized weight. With
    ``weights.scale [out]``, ``weight`` holds int8 values quantized already (a quantized checkpoint):
    they are packed as they are, with those scales."""

    def __init__(self, weights: LinearWeights, lib: ctypes.CDLL) -> None:
        super().__init__(weights)
        weight, weight_scale = weights.weight, weights.scale
        panels = -(-self.out_features // PANEL_COLUMNS)
        quads = -(-self.in_features // 4)
        if weight_scale is not None:
            self.packed, self.comp = pack_quantized(checked_int8(weight))
            self.scales = weight_scale.detach().float().reshape(-1).contiguous()
        else:
            self.packed = torch.empty(panels * quads * PANEL_COLUMNS * 4, dtype=torch.int8)
            self.scales = torch.empty(self.out_features, dtype=torch.float32)
            self.comp = torch.empty(panels * PANEL_COLUMNS, dtype=torch.int32)
            w = weight.detach()
            if w.dtype not in (torch.float32, torch.bfloat16):
                w = w.float()
            stride_n, stride_k = w.stride()
            lib.xllm_panel_pack_int8(
                w.data_ptr(), int(w.dtype == torch.bfloat16), self.out_features, self.in_features,
                stride_n, stride_k, self.packed.data_ptr(), self.scales.data_ptr(), self.comp.data_ptr(),
            )  # fmt: skip
        self._gemm = lib.xllm_panel_gemm_int8
        self._ptrs = (self.packed.data_ptr(), self.scales.data_ptr(), self.comp.data_ptr())
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def dequantized_weight(self) -> torch.Tensor:
        """The int8 weight times its scales, ``[out, in]`` float32 (for the fallback and tests)."""
        panels = -(-self.out_features // PANEL_COLUMNS)
        quads = -(-self.in_features // 4)
        q = self.packed.view(panels, quads, PANEL_COLUMNS, 4).permute(0, 2, 1, 3)
        q = q.reshape(panels * PANEL_COLUMNS, quads * 4)[: self.out_features, : self.in_features]
        return q.float() * self.scales[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0 or x.dtype not in (torch.float32, torch.bfloat16):
            return self.dequantized_linear(x)
        return mixed_gemm(
            x, self.out_features, self.float_output,
            lambda flat, rows, x16, out, o16: self._gemm(
                flat, x16, rows, self.in_features, *self._ptrs, self.out_features, self._bias_ptr, out, o16,
                torch.get_num_threads(),
            ),
        )  # fmt: skip
