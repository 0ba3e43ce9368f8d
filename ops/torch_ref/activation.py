"""Reference activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU (Gemma's ``gelu_pytorch_tanh``): ``gelu(gate) * up``."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)
