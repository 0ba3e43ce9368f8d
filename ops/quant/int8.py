"""int8 linear layers in torch: the weight rounding every backend shares, and the reference arithmetic.

Weights are rounded once, per output channel, to int8 (symmetric: scale ``max |w| / 127``, nearest even;
an all-zero channel gets scale 1). Two schemes use them: "int8" (weight-only: ``x`` stays in its dtype,
``y = x @ (q * scale)^T``) and "w8a8" (``x`` rounded to int8 per token too, the int32 sums exact).
``ReferenceInt8Linear`` computes either in torch on any device: the oracle of the CPU kernels'
tests, and what a platform without a kernel for the scheme runs. ``xllm model quantize`` and the
kernels' packers call ``quantize_int8`` so a checkpoint and ``--quantization`` round alike.
"""

from __future__ import annotations

import torch

from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

QMAX = 127.0


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of ``t [rows, k]``: ``(q int8, scale float32 [rows])``, ``t ~ q * scale``
    (nearest even; an all-zero row gets scale 1)."""
    t = t.float()
    amax = t.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(t / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def checked_int8(weight: torch.Tensor) -> torch.Tensor:
    """A quantized checkpoint's weight (int8 values, in whatever dtype it was loaded into) as int8;
    ``ValueError`` if any value is not an integer in [-127, 127]."""
    w = weight.detach().float()
    if not torch.equal(w, w.round()) or w.abs().max().item() > QMAX:
        raise ValueError("a quantized checkpoint's weight holds values that are not int8 in [-127, 127]")
    return w.to(torch.int8)


def int8_weight(weights: LinearWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [out, in], scale float32 [out])``: the weight quantized here (no ``scale``), or a
    quantized checkpoint's int8 values with its scales."""
    return weights.per_channel(quantize_int8, checked_int8)


class ReferenceInt8Linear(QuantizedLinear):
    """``x @ W^T + b`` with ``W`` int8 per output channel, in torch; call it on ``x [..., in]`` (the
    output has ``x``'s dtype, or float32 with ``float_output``). "w8a8" rounds each row of ``x`` to
    int8 per token first and sums in float64 (exact, as the int32 kernels); "int8" (weight-only)
    multiplies ``x`` by the dequantized weight in float32."""

    def __init__(self, weights: LinearWeights) -> None:
        if weights.quantization not in ("int8", "w8a8"):
            raise ValueError(f"quantization must be int8 or w8a8, got {weights.quantization!r}")
        super().__init__(weights)
        self.weight_q, self.weight_scale = int8_weight(weights)
        self.activations = "int8" if weights.quantization == "w8a8" else "none"

    def dequantized_weight(self) -> torch.Tensor:
        """``q * scale`` as float32 ``[out, in]``."""
        return self.weight_q.float() * self.weight_scale[:, None]

    def forward_rows(self, flat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self.activations != "int8":
            return self.dequantized_linear(flat)
        xq, sx = quantize_int8(flat.float())
        acc = xq.double() @ self.weight_q.double().T
        out = (acc * sx.double()[:, None] * self.weight_scale.double()[None, :]).float()
        return out if self.bias is None else out + self.bias
