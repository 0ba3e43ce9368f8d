"""The canonical form of one quantized linear layer, whatever the checkpoint format.

Every loader converts its layout into it and the checkpoint writer starts from it; the engine's
``Linear`` gets the same three tensors (``weight``, ``weight_scale``, ``weight_zero``) to pack:

- "w8a8" / "int8": ``q`` int8 ``[out, in]``, ``scale`` float32 ``[out]``; w = q * scale.
- "int4": ``q`` uint8 in [0, 15] ``[out, in]``, ``scale`` and ``zero`` float32 ``[out, in / group]``
  (``zero`` integers in [0, 15]); w = (q - zero) * scale, one scale and zero per group of inputs.
- "fp8": ``q`` float8_e4m3fn ``[out, in]``, ``scale`` float32 ``[out]``; w = q * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("w8a8", "int8", "int4", "fp8")
Q_DTYPES = {"w8a8": torch.int8, "int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}


@dataclass
class QuantizedWeight:
    """One layer's quantized weight: values ``q``, ``scale`` and (int4) ``zero`` (see the module doc)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        """Inputs per scale: the whole row for per-channel schemes."""
        groups = 1 if self.scale.dim() == 1 else self.scale.shape[1]
        return self.q.shape[1] // groups

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` these values stand for."""
        q = self.q.float()
        if self.scale.dim() == 1:
            return q * self.scale[:, None]
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        zero = self.zero.repeat_interleave(self.group_size, dim=1) if self.zero is not None else 0.0
        return (q - zero) * scale

    def check(self, scheme: str, name: str) -> None:
        """``ValueError`` naming ``name`` unless the tensors have the shapes and ranges of ``scheme``."""
        out, inp = self.q.shape
        groups = 1 if self.scale.dim() == 1 else self.scale.shape[1]
        problems = []
        if self.q.dtype != Q_DTYPES[scheme]:
            problems.append(f"values are {self.q.dtype}, not {Q_DTYPES[scheme]}")
        if scheme == "int4":
            if self.scale.dim() != 2 or self.scale.shape[0] != out or inp % groups:
                problems.append(f"scales {tuple(self.scale.shape)} do not make groups of {inp} inputs")
            elif self.zero is None or self.zero.shape != self.scale.shape:
                problems.append("zero points do not match the scales")
            elif self.q.max().item() > 15 or self.zero.min().item() < 0 or self.zero.max().item() > 15:
                problems.append("values or zero points outside [0, 15]")
        elif tuple(self.scale.shape) != (out,):
            problems.append(f"scales {tuple(self.scale.shape)}, expected one per output channel ({out})")
        if problems:
            raise ValueError(f"quantized layer {name!r}: {'; '.join(problems)}")
