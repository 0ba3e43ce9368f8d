"""The per-sequence driver of recurrent layers: state in from each sequence's slot, state out again.

A recurrent mixer (``xengine/models/qwen3_next.py``'s gated DeltaNet, ``nemotron_h.py``'s Mamba2)
supplies ``fn(inputs, state) -> (outputs, new_state)`` over a batch of equally long segments
(``inputs``: tensors ``[B, T, ...]``; ``state``: tensors ``[B, ...]``). ``scan_sequences`` splits
the step's flat token rows by sequence, starts each from its slot's state (zeros for a sequence's
first tokens), cuts a chunk at every snapshot position the step asked for and copies the state there,
and queues the final state for the slot (``ForwardContext.state_writes``: the runner commits them
once the whole forward ran). A step of decodes only runs as one batch of ``T = 1``. Snapshots are
written at once: their slots are nobody's until the step is applied.

Without a forward context (a direct call, a warm-up) all rows are one sequence from a zero state and
no state is kept.

Mixers derive from ``RecurrentMixer`` and call ``self.scan(inputs, out_dims)``: eagerly that is
``scan_sequences``; inside a compiled graph (``execution.graph_mode partial``) it is one opaque op
(``xllm::recurrent_scan``) that runs ``scan_sequences`` at replay, like attention, so the projections
and norms around it are compiled and the per-sequence loop is not traced.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from graph.forward_context import get_forward_context
from ops.opaque_op import opaque_op

State = tuple[torch.Tensor, ...]
ScanFn = Callable[[tuple[torch.Tensor, ...], State], tuple[torch.Tensor, State]]


def scan_sequences(
    layer_idx: int,
    inputs: Sequence[torch.Tensor],
    fn: ScanFn,
    zero_state: Callable[[int], State],
) -> torch.Tensor:
    """Run ``fn`` over the step's sequences (``inputs``: per-token rows ``[num_tokens, ...]``) with
    layer ``layer_idx``'s states; the outputs ``[num_tokens, ...]`` (rows past the step's tokens:
    zeros). ``zero_state(B)``: a fresh state for ``B`` sequences."""
    ctx = get_forward_context()
    meta = ctx.recurrent if ctx is not None else None
    if meta is None or ctx is None or ctx.states is None:
        out, _ = fn(tuple(x.unsqueeze(0) for x in inputs), zero_state(1))
        return out.squeeze(0)
    states = ctx.states[layer_idx]
    assert states is not None, f"layer {layer_idx} has no recurrent state in this forward context"
    num_tokens = meta.query_start_loc[-1]
    if meta.is_all_decode:
        out = _decode(
            meta.slots,
            meta.has_state,
            [x[:num_tokens] for x in inputs],
            states,
            fn,
            zero_state,
            ctx.state_writes,
        )
    else:
        outs = []
        for i, slot in enumerate(meta.slots):
            lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_inputs = [x[lo:hi] for x in inputs]
            checkpoints = meta.checkpoints[i] if meta.checkpoints else []
            outs.append(
                _prefill(
                    slot, meta.has_state[i], seq_inputs, checkpoints, states, fn, zero_state, ctx.state_writes
                )
            )
        out = torch.cat(outs) if outs else inputs[0].new_zeros((0,))
    pad = inputs[0].shape[0] - num_tokens
    if pad > 0:
        out = torch.cat([out, out.new_zeros((pad, *out.shape[1:]))])
    return out


def _decode(
    slots: list[int],
    has_state: list[bool],
    inputs: list[torch.Tensor],
    states: State,
    fn: ScanFn,
    zero_state: Callable[[int], State],
    writes: list,
) -> torch.Tensor:
    index = torch.tensor(slots, device=inputs[0].device)
    state = tuple(s.index_select(0, index) for s in states)
    if not all(has_state):  # one-token prompts start from zeros
        fresh = torch.tensor([not h for h in has_state], device=index.device)
        zeros = zero_state(len(slots))
        state = tuple(torch.where(_rows(fresh, s), z.to(s.dtype), s) for s, z in zip(state, zeros))
    out, new = fn(tuple(x.unsqueeze(1) for x in inputs), state)
    writes.extend((s, index, n.to(s.dtype)) for s, n in zip(states, new))
    return out.squeeze(1)


def _prefill(
    slot: int,
    has_state: bool,
    inputs: list[torch.Tensor],
    checkpoints: list[tuple[int, int]],
    states: State,
    fn: ScanFn,
    zero_state: Callable[[int], State],
    writes: list,
) -> torch.Tensor:
    state = tuple(s[slot : slot + 1].clone() for s in states) if has_state else zero_state(1)
    outs, lo = [], 0
    cuts = [(n, snap) for n, snap in checkpoints if 0 < n <= inputs[0].shape[0]]
    for hi, snap in [*cuts, (inputs[0].shape[0], None)]:
        if hi > lo:
            out, state = fn(tuple(x[lo:hi].unsqueeze(0) for x in inputs), state)
            outs.append(out.squeeze(0))
            lo = hi
        if snap is not None:
            for s, n in zip(states, state):
                s[snap].copy_(n[0])
    index = torch.tensor([slot], device=inputs[0].device)
    writes.extend((s, index, n.to(s.dtype)) for s, n in zip(states, state))
    return torch.cat(outs)


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


_MIXERS: dict[int, weakref.ref[RecurrentMixer]] = {}
_KEYS = itertools.count()


class RecurrentMixer(nn.Module):
    """A recurrent layer's mixer: subclasses give ``_scan(inputs, state) -> (out, new_state)`` and
    ``zero_state(batch)`` (see ``scan_sequences``) and call ``scan`` in their forward."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # its state tensors in the forward context
        self.scan_key = next(_KEYS)  # how the compiled graph's op finds this module at replay
        _MIXERS[self.scan_key] = weakref.ref(self)

    def _scan(self, inputs: tuple[torch.Tensor, ...], state: State) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def zero_state(self, batch: int) -> State:
        raise NotImplementedError

    def scan(self, inputs: Sequence[torch.Tensor], out_dims: Sequence[int]) -> torch.Tensor:
        """``scan_sequences`` over ``inputs`` (per-token rows); the output ``[num_tokens, *out_dims]``
        in ``inputs[0]``'s dtype."""
        if torch.compiler.is_compiling():
            return _scan_op(list(inputs), self.layer_idx, self.scan_key, list(out_dims))
        return scan_sequences(self.layer_idx, inputs, self._scan, self.zero_state).to(inputs[0].dtype)


def _scan_fake(inputs: list[torch.Tensor], layer: int, key: int, out_dims: list[int]) -> torch.Tensor:
    return inputs[0].new_empty((inputs[0].shape[0], *out_dims))


@opaque_op("recurrent_scan(Tensor[] inputs, int layer, int key, int[] out_dims) -> Tensor", _scan_fake)
def _scan_op(inputs: list[torch.Tensor], layer: int, key: int, out_dims: list[int]) -> torch.Tensor:
    mixer = _MIXERS[key]()
    assert mixer is not None, "a compiled graph outlived its model"
    return scan_sequences(layer, inputs, mixer._scan, mixer.zero_state).to(inputs[0].dtype)
