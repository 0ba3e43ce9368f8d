"""Reference depthwise causal 1-D convolution with a carried state (Mamba2 / gated DeltaNet mixers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[B, T, C]`` convolved per channel with ``weight`` ``[C, K]`` over the ``K - 1`` inputs
    before it (``state`` ``[B, C, K - 1]``, zeros at a sequence's start) and itself; returns
    ``(y [B, T, C], new state [B, C, K - 1])``, ``y`` through SiLU when ``silu``."""
    width = weight.shape[1]
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, C, K - 1 + T]
    y = F.conv1d(xs, weight.unsqueeze(1), bias, groups=weight.shape[0])  # [B, C, T]
    if silu:
        y = F.silu(y)
    return y.transpose(1, 2), xs[:, :, xs.shape[2] - (width - 1) :]
