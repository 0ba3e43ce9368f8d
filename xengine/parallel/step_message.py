"""What rank 0 sends every expert-parallel worker before each forward: the step's inputs, as tensors.

Two broadcasts on the control group: a fixed-size int64 header, then one int64 payload holding input
ids, positions, the attention metadata and the copy-on-write block copies. No pickle: the message is
numbers only, and workers rebuild ``ModelInputs`` from them exactly as rank 0 built them (with the rows
whose logits rank 0 computes: under tensor parallelism every rank computes its vocabulary columns).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ops.attention import AttentionMetadata
from xengine.parallel.shm_channel import StepChannel
from xengine.runner.input_batch import ModelInputs

KIND_STEP, KIND_STOP, KIND_SETUP = 1, 2, 3
_HEADER = 11  # kind, tokens, seqs, block-table width, copies, block size, step index, EPLB action, 3 values


@dataclass
class StepMessage:
    kind: int
    inputs: ModelInputs | None = None
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    step_index: int = 0
    eplb_action: int = 0
    values: tuple[int, ...] = (0, 0, 0)  # KIND_SETUP: (num KV blocks, block size, max model len)


def publish_step(
    group: object,
    inputs: ModelInputs,
    copies: list[tuple[int, int]],
    step_index: int,
    eplb_action: int,
    channel: StepChannel | None = None,
) -> None:
    """Rank 0: send one step to every worker (call right before the forward); through ``channel``
    (shared memory) when the group has one."""
    meta = inputs.meta
    num_seqs = meta.num_seqs
    width = int(meta.block_tables.shape[1]) if num_seqs else 0
    header = [
        KIND_STEP,
        inputs.num_tokens,
        num_seqs,
        width,
        len(copies),
        meta.block_size,
        step_index,
        eplb_action,
    ]
    parts = [
        inputs.input_ids,
        inputs.positions,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables.reshape(-1),
        meta.slot_mapping,
        torch.tensor([x for pair in copies for x in pair], dtype=torch.int64),
        inputs.logits_indices,  # tensor parallel: every rank computes its columns of these rows' logits
        torch.tensor([x for span in inputs.prompt_spans for x in span], dtype=torch.int64),  # and these
    ]
    payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    _send(group, header + [len(inputs.logits_indices), len(inputs.prompt_spans), 0], payload, channel)


def publish_control(
    group: object, kind: int, values: tuple[int, int, int] = (0, 0, 0), channel: StepChannel | None = None
) -> None:
    """Rank 0: a message without inputs (``KIND_STOP``, or ``KIND_SETUP`` with the KV pool geometry)."""
    _send(group, [kind, 0, 0, 0, 0, 0, 0, 0, *values], torch.zeros(0, dtype=torch.int64), channel)


def receive(group: object, device: torch.device, channel: StepChannel | None = None) -> StepMessage:
    """A worker: wait for rank 0's next message."""
    if channel is not None:
        header, payload = channel.receive()
    else:
        header_t = torch.zeros(_HEADER, dtype=torch.int64)
        dist.broadcast(header_t, 0, group=group)
        header, payload = header_t.tolist(), None
    kind, t, b, w, c, block_size, step_index, action, *values = header
    if kind != KIND_STEP:
        return StepMessage(kind, values=tuple(values))
    num_logits, num_spans = values[0], values[1]
    if payload is None:
        payload = torch.zeros(
            3 * t + 2 * b + 1 + b * w + 2 * c + num_logits + 2 * num_spans, dtype=torch.int64
        )
        dist.broadcast(payload, 0, group=group)
    sizes = [t, t, b + 1, b, b * w, t, 2 * c, num_logits, 2 * num_spans]
    ids, pos, qsl, seq_lens, tables, slots, copies, logits_rows, spans = torch.split(payload, sizes)
    starts = qsl.tolist()
    lens = seq_lens.tolist()
    query_lens = [starts[i + 1] - starts[i] for i in range(b)]
    meta = AttentionMetadata(
        query_start_loc=qsl.to(device, torch.int32),
        seq_lens=seq_lens.to(device, torch.int32),
        block_tables=tables.view(b, w).to(device, torch.int32),
        slot_mapping=slots.to(device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=lens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(lens, default=0),
        block_size=block_size,
    )
    inputs = ModelInputs(ids.to(device), pos.to(device), meta, logits_rows.to(device), t)
    flat = spans.tolist()
    inputs.prompt_spans = list(zip(flat[::2], flat[1::2]))
    pairs = copies.tolist()
    return StepMessage(kind, inputs, list(zip(pairs[::2], pairs[1::2])), step_index, action)


def _send(group: object, header: list[int], payload: torch.Tensor, channel: StepChannel | None) -> None:
    if channel is not None:
        if not channel.send(header, payload):  # too large for the channel: the payload over gloo
            dist.broadcast(payload, 0, group=group)
        return
    dist.broadcast(torch.tensor(header, dtype=torch.int64), 0, group=group)
    if header[0] == KIND_STEP:
        dist.broadcast(payload, 0, group=group)
