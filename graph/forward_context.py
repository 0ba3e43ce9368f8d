"""The forward context: what attention needs during one forward, kept outside the traced graph.

Graph runners trace and replay the model's token work (``forward_tokens(input_ids, positions)``);
the per-step attention metadata and the per-layer KV caches change every step and must not become
graph inputs or guards. The runner sets them here around each forward; the attention op
(``graph/attention_op.py``) reads them. A ``ContextVar``, so a forward on a worker thread (async
scheduling) sees its own step's context.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ops.attention_metadata import AttentionMetadata
from ops.lora import LoRAGroups
from ops.recurrent_metadata import RecurrentMetadata


@dataclass
class ForwardContext:
    meta: AttentionMetadata | None  # None: a capture / warm-up run (attention returns zeros)
    caches: list[Any]  # per layer: what ``ops.attention.attention`` takes as ``kv_cache``
    num_tokens: int  # real tokens of the step; rows past them are bucket padding
    # set while the step may be interrupted between layers (offline work only): an online arrival
    # sets it and the next layer's attention raises ``StepInterrupted`` (``graph/interrupt.py``)
    interrupt: threading.Event | None = None
    # the runner's per-layer checks (``xengine/colocation/layer_checks.py``) test ``interrupt`` at
    # points a step can resume from: attention then leaves the check to them
    resumable_checks: bool = False
    # the sliding-window layers' metadata when they keep KV in a pool of their own (their block tables
    # and slots; ``memory/sliding_window.py``), and which layers those are
    window_meta: AttentionMetadata | None = None
    window_layers: frozenset[int] = frozenset()
    # recurrent layers (``xengine/layers/recurrent.py``): the step's sequences and state slots, and per
    # layer the state tensors (None for a layer without state)
    recurrent: RecurrentMetadata | None = None
    states: list[tuple[Any, ...] | None] | None = None
    # the new states of the step's sequences, ``(tensor, slot indices, values)``: written into ``states``
    # only once the whole forward ran (``commit_states``, on leaving ``forward_context`` normally), so a step that fails or is stopped midway
    # leaves every sequence's state as it was and can simply run again
    state_writes: list[tuple[Any, Any, Any]] = field(default_factory=list)
    # LoRA: the step's rows grouped by adapter slot (``graph/lora_op.py``); None: base model only
    lora: LoRAGroups | None = None

    def commit_states(self) -> None:
        for tensor, index, values in self.state_writes:
            tensor.index_copy_(0, index, values)
        self.state_writes.clear()

    def meta_of(self, layer: int) -> AttentionMetadata | None:
        """The metadata attention of ``layer`` reads."""
        if self.window_meta is not None and layer in self.window_layers:
            return self.window_meta
        return self.meta


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("xllm_forward", default=None)


def get_forward_context() -> ForwardContext | None:
    return _current.get()


@contextlib.contextmanager
def forward_context(
    meta: AttentionMetadata | None,
    caches: list[Any],
    num_tokens: int,
    interrupt: threading.Event | None = None,
    resumable_checks: bool = False,
    window_meta: AttentionMetadata | None = None,
    window_layers: frozenset[int] = frozenset(),
    recurrent: RecurrentMetadata | None = None,
    states: list[tuple[Any, ...] | None] | None = None,
    lora: LoRAGroups | None = None,
) -> Iterator[ForwardContext]:
    ctx = ForwardContext(
        meta, caches, num_tokens, interrupt, resumable_checks, window_meta, window_layers, recurrent, states
    )
    ctx.lora = lora
    token = _current.set(ctx)
    try:
        yield ctx
        ctx.commit_states()  # the forward ran to its end (an exception leaves every state as it was)
    finally:
        _current.reset(token)
