"""``LinearWeights``: what crosses the linear facade (``ops/linear.py``) to a platform's ``pack_linear``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearWeights:
    """A linear layer's weights and how to run them, as every backend's ``pack_linear`` receives them.

    ``float_output``: the caller wants float32 out whatever the input (logits). ``quantization``: "none",
    "w8a8", "int8", "int4" or "fp8". ``scale`` None: ``weight`` is quantized by the backend; otherwise
    ``weight`` holds a quantized checkpoint's values with these scales (and ``zero``, int4's zero points);
    ``ops/linear.py`` has the layouts."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    float_output: bool = False
    quantization: str = "none"
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def check_symmetric(self) -> None:
        """``ValueError`` where a zero point comes with a symmetric scheme (all but int4)."""
        if self.zero is not None and self.quantization != "int4":
            raise ValueError(
                f"--quantization {self.quantization} is symmetric: a weight zero point cannot be used"
            )

    def per_channel(
        self,
        quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        check: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [out, in], scale float32 [out])`` of a per-output-channel scheme: ``weight`` rounded by
        ``quantize`` (``scale`` None), or a checkpoint's values (``check`` validates and converts them)
        with its scales."""
        if self.scale is None:
            return quantize(self.weight.detach())
        return check(self.weight), self.scale.detach().float().reshape(-1).contiguous()
