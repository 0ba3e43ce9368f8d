"""Layer-level interruption of a step (xLLM §3.1, "model execution interruption").

A step that carries only offline work may be given an interrupt event in its forward context. When
an online request arrives, the engine process sets the event; the attention op of the next layer
sees it and raises ``StepInterrupted`` before touching that layer's KV, so the step ends within one
layer instead of running to its end. Eager forwards also check at each layer's start, before its MLP
and between the MLP's two projections (``interrupt_point``): the longest stretch without a check is
then the gate/up projection, about half a layer, and the mean wait about a sixth of one (one layer of
a 512-token chunk of the small checkpoint: ~21 ms). Where the forward checks at these points (the
synchronous engine's eager forward: ``ForwardContext.resumable_checks``) attention leaves the check
to them, so every stop carries a ``ResumePoint``.

Nothing of a stopped step is applied (``Scheduler.update`` never ran). With a ``ResumePoint`` the
engine keeps the step and, after the online prefill, carries its forward on from that point; the
KV its finished layers wrote stays (``xengine/step_resume.py``). Without one (a stop at the
attention op of a compiled graph) its sequences run again later and the rows its layers wrote are
rewritten then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graph.forward_context import ForwardContext, get_forward_context


@dataclass
class ResumePoint:
    """Where an eager forward stopped, with what it had computed: ``DecoderModel.forward_from``
    carries on from here. ``phase``: "layer" (before layer ``layer``: ``hidden`` / ``residual`` are
    the previous layer's outputs), "mlp" (layer ``layer``'s attention done: ``hidden`` is the MLP's
    input) or "down" (its MLP's gate/up done: ``hidden`` is the down projection's input)."""

    phase: str
    layer: int
    hidden: torch.Tensor
    residual: torch.Tensor | None


class StepInterrupted(Exception):
    """The step was stopped between layers for a higher-priority arrival; nothing of it applies.
    ``resume``: where it stopped, when the forward can carry on from there (eager checks); the
    engine keeps the step and resumes it (``xengine/step_resume.py``) instead of computing it again."""

    def __init__(self, layer: int, resume: ResumePoint | None = None) -> None:
        super().__init__(f"step interrupted before layer {layer}")
        self.layer = layer
        self.resume = resume
        self.step: Any = None  # the prepared step, attached by the model runner


def check_interrupt(ctx: ForwardContext, layer: int, resume: ResumePoint | None = None) -> None:
    """Raise ``StepInterrupted`` when the step's interrupt event is set (called per layer)."""
    if ctx.interrupt is not None and ctx.interrupt.is_set():
        raise StepInterrupted(layer, resume)


def interrupt_point(
    layer: int, phase: str = "", hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> None:
    """A check inside an eager forward (compiled graphs check at attention, which stays eager);
    with ``phase`` and ``hidden`` the stop is resumable from here."""
    ctx = get_forward_context()
    if ctx is not None and ctx.interrupt is not None and ctx.interrupt.is_set():
        point = ResumePoint(phase, layer, hidden, residual) if phase and hidden is not None else None
        raise StepInterrupted(layer, point)
