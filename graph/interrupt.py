"""A forward stopped between layers: ``StepInterrupted`` and where it stopped (``ResumePoint``).

An offline step may carry an interrupt event in its forward context; once it is set, the next check
raises ``StepInterrupted`` and nothing of the step applies. The attention op checks once per layer
(the one check compiled graphs keep, since attention stays eager); eager forwards check at finer,
resumable points that the engine installs on the model (``xengine/colocation/layer_checks.py``). Why
and when a step stops: ``docs/colocation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graph.forward_context import ForwardContext


@dataclass
class ResumePoint:
    """Where an eager forward stopped, with what it had computed, to carry it on from. ``phase``:
    "layer" (before layer ``layer``: ``hidden`` / ``residual`` are the previous layer's outputs),
    "mlp" (layer ``layer``'s attention done: ``hidden`` is the MLP's input) or "down" (its MLP's
    gate/up done: ``hidden`` is the down projection's input)."""

    phase: str
    layer: int
    hidden: torch.Tensor
    residual: torch.Tensor | None


class StepInterrupted(Exception):
    """The step was stopped between layers for a higher-priority arrival; nothing of it applies.
    ``resume``: where it stopped, when the forward can carry on from there (eager checks);
    ``step``: the prepared step, attached by the model runner."""

    def __init__(self, layer: int, resume: ResumePoint | None = None) -> None:
        super().__init__(f"step interrupted before layer {layer}")
        self.layer = layer
        self.resume = resume
        self.step: Any = None


def check_interrupt(ctx: ForwardContext, layer: int, resume: ResumePoint | None = None) -> None:
    """Raise ``StepInterrupted`` when the step's interrupt event is set (called per layer)."""
    if ctx.interrupt is not None and ctx.interrupt.is_set():
        raise StepInterrupted(layer, resume)
