"""FP8 (e4m3) linear layers in torch: the arithmetic the CUDA kernel runs, and its oracle.

Weights are rounded once, per output channel, to e4m3 (symmetric: scale ``max |w| / 448``); each input
row is rounded to e4m3 per token as it arrives (dynamic, symmetric). Products of two e4m3 values are
exact in float32, the sums are float32 (what the tensor cores accumulate in), and the two scales are
applied to the sum. ``ReferenceFP8Linear`` is what ``--quantization fp8`` runs where no platform kernel
exists (the CPU: slow, correct), and the oracle of ``ops/cuda_kernels/linear_fp8.py``'s tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3 per row of ``t [rows, k]``: ``(q float8_e4m3fn, scale float32 [rows])``, ``t ~ q *
    scale`` (round to nearest even; an all-zero row gets scale 1)."""
    t = t.float()
    amax = t.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (t / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)  # clamp: the division may pass 448
    return q, scale


def checked_fp8(weight: torch.Tensor) -> torch.Tensor:
    """A quantized checkpoint's weight (e4m3 values, in whatever dtype it was loaded into) as e4m3;
    ``ValueError`` if any value is not an e4m3 value."""
    w = weight.detach()
    if w.dtype == E4M3:
        return w
    q = w.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    if not torch.equal(q.float(), w.float()):
        raise ValueError("a quantized checkpoint's fp8 weight holds values that are not float8_e4m3fn")
    return q


def fp8_weight(weights: LinearWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q e4m3 [out, in], scale float32 [out])``: the weight quantized here (no ``scale``), or a
    quantized checkpoint's e4m3 values with its scales."""
    return weights.per_channel(quantize_fp8_rows, checked_fp8)


class ReferenceFP8Linear(QuantizedLinear):
    """``x @ W^T + b`` with ``W`` in e4m3 per output channel and ``x`` rounded to e4m3 per token, in
    torch on any device; call it on ``x [..., in]``: the output has ``x``'s dtype, or float32 with
    ``float_output``. With ``weights.scale [out]``, ``weight`` holds e4m3 values already (a quantized
    checkpoint), kept as they are with those scales."""

    def __init__(self, weights: LinearWeights) -> None:
        super().__init__(weights)
        self.weight_q, self.weight_scale = fp8_weight(weights)

    def dequantized_weight(self) -> torch.Tensor:
        """The e4m3 weight times its scales, ``[out, in]`` float32 (for tests)."""
        return self.weight_q.float() * self.weight_scale[:, None]

    def forward_rows(self, flat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xq, sx = quantize_fp8_rows(flat)
        # e4m3 x e4m3 products are exact in float32; the sums are float32, as on the tensor cores
        acc = F.linear(xq.float(), self.weight_q.float())
        out = acc * sx[:, None] * self.weight_scale[None, :]
        if self.bias is not None:
            out = out + self.bias
        return out
