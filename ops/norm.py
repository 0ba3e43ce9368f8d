"""Normalisation facade: RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch

from ops.registry import get_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, statistics in float32; same dtype as ``x``."""
    return get_op("rms_norm")(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``: the normalised input of the next sub-layer and
    the new residual stream. Backends may reuse the inputs' storage; callers use only the return values."""
    return get_op("fused_add_rms_norm")(x, residual, weight, eps)
