"""Turn a ``SchedulePlan`` into flat model inputs and attention metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from ops.attention import AttentionMetadata
from xengine.scheduler.plan import SchedulePlan


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S]: last token of each sampling sequence (and its drafts)
    num_tokens: int
    # the sliding-window layers' metadata when they have a pool of their own (``window_metadata``)
    window_meta: AttentionMetadata | None = None
    # tensor parallel: ``(first row, rows)`` of the prompt logprobs computed after ``logits_indices``
    prompt_spans: list[tuple[int, int]] = field(default_factory=list)


def _tokens(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens at positions ``start .. end - 1`` of prompt + output, without concatenating them."""
    n = len(prompt)
    if start >= n:
        return output[start - n : end - n]
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[: end - n]


def build_inputs(
    plan: SchedulePlan, block_size: int, device: torch.device, kv_slots: list[int] | None = None
) -> ModelInputs:
    """Flat inputs for ``plan``; ``kv_slots``: each sequence's xTensor slot (None: paged layout)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    query_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    for s in plan.seqs:
        req = s.req
        num_new = s.num_new_tokens
        end = s.end
        start = end - num_new
        table = plan.block_tables[req.seq_id]
        if num_new == 1:  # a decoding sequence: one token, no ranges (the common case, per step)
            prompt = req.prompt_token_ids
            n = len(prompt)
            input_ids.append(prompt[start] if start < n else req.output_token_ids[start - n])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            drafts = s.draft_token_ids  # speculative decoding: computed after the known tokens
            input_ids.extend(_tokens(req.prompt_token_ids, req.output_token_ids, start, end - len(drafts)))
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(query_start[-1] + num_new)
        seq_lens.append(end)
        query_lens.append(num_new)
        tables.append(table)
        if s.sample:  # the last token's logits, and each draft's (the target's distributions to verify)
            logits_indices.extend(range(query_start[-1] - 1 - len(s.draft_token_ids), query_start[-1]))
    max_blocks = max(map(len, tables))
    padded = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for row, table in zip(padded, tables):
        row[: len(table)] = table

    def _t(x: list, dtype: type) -> torch.Tensor:  # through numpy: a third of torch.tensor's time
        return torch.from_numpy(np.array(x, dtype=dtype)).to(device)

    meta = AttentionMetadata(
        query_start_loc=_t(query_start, np.int32),
        seq_lens=_t(seq_lens, np.int32),
        block_tables=torch.from_numpy(padded).to(device),
        slot_mapping=_t(slots, np.int64),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        kv_slots=kv_slots,
    )
    return ModelInputs(
        input_ids=_t(input_ids, np.int64),
        positions=_t(positions, np.int64),
        meta=meta,
        logits_indices=_t(logits_indices, np.int64),
        num_tokens=len(input_ids),
    )


def window_metadata(
    plan: SchedulePlan, meta: AttentionMetadata, block_size: int, kv_slots: list[int] | None = None
) -> AttentionMetadata:
    """``meta`` for the sliding-window layers of a plan with ``window_block_tables``: the same batch,
    their own block tables (released blocks read as the null block, masked out by the window), the
    slots of the new tokens in their pool and (xTensor) each sequence's slot in their layout."""
    assert plan.window_block_tables is not None
    tables = [plan.window_block_tables[s.req.seq_id] for s in plan.seqs]
    slots: list[int] = []
    for s, table in zip(plan.seqs, tables):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s.start, s.end))
    padded = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
    for row, table in zip(padded, tables):
        row[: len(table)] = table
    device = meta.slot_mapping.device
    return dataclasses.replace(
        meta,
        block_tables=torch.from_numpy(padded).to(device),
        slot_mapping=torch.from_numpy(np.array(slots, dtype=np.int64)).to(device),
        kv_slots=kv_slots,
        scratch={},
    )
