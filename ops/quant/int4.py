"""int4 weight-only linear layers in torch: the rounding every backend shares, and the reference.

Weights are rounded per output channel and group of ``group_size`` consecutive inputs (128 unless a
checkpoint says otherwise; the last group may be shorter) to 4-bit codes, asymmetric: over a group
with ``lo = min(w, 0)`` and ``hi = max(w, 0)``, ``scale = (hi - lo) / 15`` (1 for an all-zero group),
``zero = round(-lo / scale)`` in [0, 15], ``q = clamp(round(w / scale) + zero, 0, 15)`` (nearest
even), and ``w ~ (q - zero) * scale`` — the GPTQ / AWQ layout (codes, per-group scales and integer
zeros). Including 0 in the range keeps the zero in [0, 15]. ``ReferenceInt4Linear`` multiplies ``x`` by
the dequantized weight in float32: the oracle of the CPU kernels' tests, and what a platform without
an int4 kernel runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

GROUP_SIZE = 128
QMAX = 15.0


def quantize_int4(
    weight: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q uint8 [out, in] in [0, 15], scale float32 [out, groups], zero float32 [out, groups])`` for
    ``weight [out, in]``, groups of ``group_size`` inputs (the last one shorter if ``in`` is not a
    multiple)."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = -(-in_features // group_size)
    padded = F.pad(w, (0, groups * group_size - in_features)).view(out_features, groups, group_size)
    lo = padded.amin(dim=-1).clamp(max=0.0)  # padding is 0: inside [lo, hi] anyway
    hi = padded.amax(dim=-1).clamp(min=0.0)
    scale = torch.where(hi > lo, (hi - lo) / QMAX, torch.ones_like(hi))
    zero = torch.round(-lo / scale).clamp_(0.0, QMAX)
    q = torch.round(padded / scale[..., None]) + zero[..., None]
    q = q.clamp_(0.0, QMAX).view(out_features, -1)[:, :in_features].to(torch.uint8)
    return q, scale, zero


def group_size_of(in_features: int, num_groups: int) -> int:
    """A checkpoint's group size from its scales' shape: ``in_features / num_groups``; ``ValueError``
    unless that is a whole number."""
    if num_groups < 1 or in_features % num_groups:
        raise ValueError(
            f"int4 weight_scale has {num_groups} groups, which do not divide the {in_features} inputs"
        )
    return in_features // num_groups


def int4_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor | None, weight_zero: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(q uint8 [out, in], scale [out, groups], zero [out, groups], group_size)``: ``weight`` quantized
    here (``weight_scale`` None), or a quantized checkpoint's codes, scales and zeros (zeros None: 8,
    the symmetric layouts' midpoint); ``ValueError`` naming what does not fit."""
    if weight_scale is None:
        q, scale, zero = quantize_int4(weight)
        return q, scale, zero, GROUP_SIZE
    out_features, in_features = weight.shape
    scale = weight_scale.detach().float().reshape(out_features, -1).contiguous()
    group_size = group_size_of(in_features, scale.shape[1])
    zero = torch.full_like(scale, 8.0) if weight_zero is None else weight_zero.detach().float()
    zero = zero.reshape(scale.shape).contiguous()
    w = weight.detach().float()
    for name, t in (("weight", w), ("weight_zero", zero)):
        if not torch.equal(t, t.round()) or t.min().item() < 0 or t.max().item() > QMAX:
            raise ValueError(f"an int4 checkpoint's {name} holds values that are not integers in [0, 15]")
    return w.to(torch.uint8), scale, zero, group_size


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``(q - zero) * scale`` as float32 ``[out, in]`` (each group's scale and zero over its inputs)."""
    in_features = q.shape[1]
    scale = scale.repeat_interleave(group_size, dim=1)[:, :in_features]
    zero = zero.repeat_interleave(group_size, dim=1)[:, :in_features]
    return (q.float() - zero) * scale


class ReferenceInt4Linear(QuantizedLinear):
    """``x @ W^T + b`` with ``W`` int4 per group (asymmetric), in torch; call it on ``x [..., in]`` (the
    output has ``x``'s dtype, or float32 with ``float_output``). ``weights.scale [out, groups]`` (and
    ``zero``): ``weight`` holds codes in [0, 15] already (a quantized checkpoint)."""

    def __init__(self, weights: LinearWeights) -> None:
        super().__init__(weights)
        self.weight_q, self.weight_scale, self.weight_zero, self.group_size = int4_weight(
            weights.weight, weights.scale, weights.zero
        )

    def dequantized_weight(self) -> torch.Tensor:
        """``(q - zero) * scale`` as float32 ``[out, in]``."""
        return dequantize_int4(self.weight_q, self.weight_scale, self.weight_zero, self.group_size)

    def forward_rows(self, flat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self.dequantized_linear(flat)
