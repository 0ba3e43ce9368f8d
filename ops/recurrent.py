"""Recurrent-mixer ops: the depthwise causal convolution every Mamba2 / gated-DeltaNet mixer runs
before its scan. The scans have facades of their own: ``ops/gated_delta.py`` (Qwen3-Next's gated delta
rule) and ``ops/ssd.py`` (Mamba2's SSD). Each takes a batch of equally long segments and the state they
start from, and returns the outputs and the state after them (``xengine/layers/recurrent.py`` drives
them per sequence)."""

from __future__ import annotations

import torch

from ops.registry import get_op


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv: ``x`` ``[B, T, C]``, ``weight`` ``[C, K]``, ``state`` ``[B, C, K - 1]``
    (the inputs before ``x``); returns ``(y [B, T, C], new state)``, ``y`` through SiLU when ``silu``."""
    return get_op("causal_conv1d")(x, weight, bias, state, silu)
