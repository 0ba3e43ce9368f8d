"""Where an eager forward may stop for an online arrival: checks the model runner installs on a
decoder's layers, so that model files stay math only.

Each check is a forward hook: before each layer, after its attention (before the MLP) and, in a dense
MLP, before the down projection (the MLP is most of a layer, so the longest stretch without a check is
the gate/up projection). When the step's interrupt event is set, a check raises ``StepInterrupted``
with the ``ResumePoint`` of where it stopped; ``resume`` carries the forward on from there with the
same operations on the same tensors, so the tokens are bit for bit those of a forward never stopped.
Compiled graphs skip these checks (attention keeps its own: ``graph/interrupt.py``). See
``docs/colocation.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graph.forward_context import get_forward_context
from graph.interrupt import ResumePoint, StepInterrupted
from xengine.models.decoder import DecoderMLP, DecoderModel

Hook = Callable[..., None]


def _stop_requested() -> bool:
    """The running forward is eager and its step's interrupt event is set."""
    if torch.compiler.is_compiling():
        return False
    ctx = get_forward_context()
    return ctx is not None and ctx.interrupt is not None and ctx.interrupt.is_set()


class LayerChecks:
    """The resumable interruption points of one decoder (``DecoderModel``), as forward hooks."""

    def __init__(self, decoder: DecoderModel) -> None:
        self.decoder = decoder
        # the residual stream of a dense layer from its attention to its down projection
        self._residual: torch.Tensor | None = None
        for i, layer in enumerate(decoder.layers):
            dense = isinstance(layer.mlp, DecoderMLP)  # a check inside the MLP too
            layer.register_forward_pre_hook(self._before_layer(i))
            layer.post_attention_layernorm.register_forward_hook(self._before_mlp(i, dense))
            if dense:
                layer.mlp.down_proj.register_forward_pre_hook(self._before_down(i))

    @classmethod
    def install(cls, model: nn.Module) -> LayerChecks | None:
        """Checks on ``model``'s decoder layers; None for a model without them (its steps then stop
        only at the attention op, and are computed again)."""
        decoder = getattr(model, "model", None)
        return cls(decoder) if isinstance(decoder, DecoderModel) else None

    def _before_layer(self, i: int) -> Hook:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if _stop_requested():
                _, hidden, residual = args
                raise StepInterrupted(i, ResumePoint("layer", i, hidden, residual))

        return hook

    def _before_mlp(self, i: int, dense: bool) -> Hook:
        def hook(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if torch.compiler.is_compiling():
                return
            ctx = get_forward_context()
            if ctx is None or ctx.interrupt is None:
                return
            hidden, residual = output
            if ctx.interrupt.is_set():
                raise StepInterrupted(i, ResumePoint("mlp", i, hidden, residual))
            if dense:
                self._residual = residual

        return hook

    def _before_down(self, i: int) -> Hook:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if torch.compiler.is_compiling():
                return
            residual, self._residual = self._residual, None
            if _stop_requested():
                raise StepInterrupted(i, ResumePoint("down", i, args[0], residual))

        return hook

    def resume(self, point: ResumePoint, positions: torch.Tensor) -> torch.Tensor:
        """The rest of a forward stopped at ``point`` (same step, same forward context): the hidden
        states the forward it interrupted would have returned."""
        hidden, residual, start = point.hidden, point.residual, point.layer
        if point.phase != "layer":
            mlp = self.decoder.layers[start].mlp
            if isinstance(mlp, DecoderMLP):  # stopped again inside it: the residual stream is this
                self._residual = residual
            hidden = mlp.down_proj(hidden) if point.phase == "down" else mlp(hidden)
            start += 1
        return self.decoder.forward_layers(positions, hidden, residual, start)
