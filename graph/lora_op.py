"""LoRA's low-rank updates as one opaque custom op (``xllm::lora``), so compiled graphs keep it eager.

Which rows of a step belong to which adapter changes every step: the runner puts the step's groups
(``ops.lora.LoRAGroups``) in the forward context and this op reads them, as attention reads its
metadata. A layer holds every adapter slot's weights (``a``, ``b``: buffers, so a compiled graph reads
the slots' current contents). Eager steps without adapters skip it; in a compiled graph it always runs
(and copies ``y`` when the step has none).
"""

from __future__ import annotations

import torch

from graph.forward_context import get_forward_context
from ops.lora import add_lora_delta
from ops.opaque_op import opaque_op


def _lora_fake(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(y)


@opaque_op("lora(Tensor x, Tensor y, Tensor a, Tensor b) -> Tensor", _lora_fake)
def _lora_op(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ctx = get_forward_context()
    out = y.clone()
    if ctx is not None and ctx.lora is not None and ctx.meta is not None:
        add_lora_delta(x, out, a, b, ctx.lora)  # its groups cover real rows only (not bucket padding)
    return out


def apply_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``y`` (a projection of ``x``) with the step's adapters' updates added to their rows."""
    if torch.compiler.is_compiling():
        return _lora_op(x, y, a, b)
    ctx = get_forward_context()
    if ctx is None or ctx.lora is None or not ctx.lora.groups:
        return y
    return add_lora_delta(x, y, a, b, ctx.lora)
