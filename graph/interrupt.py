"""Layer-level interruption of a step (xLLM §3.1, "model execution interruption").

A step that carries only offline work may be given an interrupt event in its forward context. When
an online request arrives, the engine process sets the event; the attention op of the next layer
sees it and raises ``StepInterrupted`` before touching that layer's KV, so the step ends within one
layer instead of running to its end. Eager forwards also check at each layer's start, before its MLP
and between the MLP's two projections (``interrupt_point``): the longest stretch without a check is
then the gate/up projection, about half a layer, and the mean wait about a sixth of one (one layer of
a 512-token chunk of the small checkpoint: ~21 ms). The engine then discards the step: nothing of it was applied
(``Scheduler.update`` never ran), so its sequences are still where they were and run again later,
after the online request's prefill. KV rows the interrupted layers wrote are rewritten then.
"""

from __future__ import annotations

from graph.forward_context import ForwardContext, get_forward_context


class StepInterrupted(Exception):
    """The step was stopped between layers for a higher-priority arrival; nothing of it applies."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"step interrupted before layer {layer}")
        self.layer = layer


def check_interrupt(ctx: ForwardContext, layer: int) -> None:
    """Raise ``StepInterrupted`` when the step's interrupt event is set (called per layer)."""
    if ctx.interrupt is not None and ctx.interrupt.is_set():
        raise StepInterrupted(layer)


def interrupt_point(layer: int) -> None:
    """A second check inside a layer, before its MLP (eager forwards only: compiled graphs check at
    attention, which stays eager). Halves the expected wait of an online arrival."""
    ctx = get_forward_context()
    if ctx is not None:
        check_interrupt(ctx, layer)
