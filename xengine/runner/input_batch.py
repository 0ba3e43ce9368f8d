"""Turn a ``SchedulePlan`` into flat model inputs and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.attention import AttentionMetadata
from xengine.scheduler.plan import SchedulePlan


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S]: last token of each sampling sequence
    num_tokens: int


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
        start, end = s.start, s.end
        input_ids.extend(_tokens(req.prompt_token_ids, req.output_token_ids, start, end))
        positions.extend(range(start, end))
        table = plan.block_tables[req.seq_id]
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(query_start[-1] + s.num_new_tokens)
        seq_lens.append(end)
        query_lens.append(s.num_new_tokens)
        tables.append(table)
        if s.sample:
            logits_indices.append(query_start[-1] - 1)
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]

    def _t(x: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    meta = AttentionMetadata(
        query_start_loc=_t(query_start, torch.int32),
        seq_lens=_t(seq_lens, torch.int32),
        block_tables=_t(padded, torch.int32),
        slot_mapping=_t(slots, torch.int64),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        kv_slots=kv_slots,
    )
    return ModelInputs(
        input_ids=_t(input_ids, torch.int64),
        positions=_t(positions, torch.int64),
        meta=meta,
        logits_indices=_t(logits_indices, torch.int64),
        num_tokens=len(input_ids),
    )
