"""Activation facade."""

from __future__ import annotations

import torch

from ops.registry import get_op


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: ``x`` is ``[..., 2 * I]`` laid out ``[gate | up]``; returns ``silu(gate) * up``: ``[..., I]``."""
    return get_op("silu_and_mul")(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU gate (Gemma): ``x`` is ``[..., 2 * I]`` laid out ``[gate | up]``; returns
    ``gelu_tanh(gate) * up``: ``[..., I]``."""
    return get_op("gelu_tanh_and_mul")(x)
