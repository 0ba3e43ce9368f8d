"""Reference RMSNorm (statistics in float32, as HF does).

In float32 the products are taken in HF's order (``x * rsqrt(...)`` then ``* weight``), in place on one
fresh tensor, so results are bitwise those of HF's ``weight * (x * rsqrt(mean(x^2) + eps))``.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv_rms = xf.square().mean(dim=-1, keepdim=True).add_(eps).rsqrt_()
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.mul(x, inv_rms).mul_(weight)
    return weight * (xf * inv_rms).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x is the sub-layer's fresh output; the facade lets backends reuse the inputs' storage.
    residual = x.add_(residual) if x.dtype == residual.dtype else x + residual
    return rms_norm(residual, weight, eps), residual
