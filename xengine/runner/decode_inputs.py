"""Model inputs of a decode-only step (``SchedulePlan.decode_only``): one pass, no general case.

Most steps of a busy engine have every sequence computing one known token and sampling the next.
Their inputs come from one pass over the sequences (last token, position, KV slot, block table) and
a few list-to-tensor conversions; the query offsets and logits rows depend only on the batch size
and are kept between steps (nothing writes into step inputs). ``build_inputs`` gives the same
tensors for the same plan (``tests/xengine/step/test_decode_inputs.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from ops.attention import AttentionMetadata
from xengine.runner.input_batch import ModelInputs
from xengine.scheduler.plan import SchedulePlan


def padded_tables(tables: list[list[int]]) -> np.ndarray:
    """``[len(tables), longest]`` int32, each table's block ids from column 0, 0 after them."""
    width = max(map(len, tables))
    return np.array([t if len(t) == width else t + [0] * (width - len(t)) for t in tables], dtype=np.int32)


def _tensor(values: list[int], dtype: type, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.array(values, dtype=dtype))  # through numpy: a third of torch.tensor's time
    return t if device.type == "cpu" else t.to(device)


class DecodeInputs:
    """Builds a decode-only plan's ``ModelInputs``; keeps the per-batch-size index tensors."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _indices(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query_start_loc [n + 1] int32, logits_indices [n] int64)`` for ``n`` rows: 0, 1, 2, ..."""
        got = self._index.get(n)
        if got is None:
            got = self._index[n] = (
                torch.arange(n + 1, dtype=torch.int32, device=self.device),
                torch.arange(n, dtype=torch.int64, device=self.device),
            )
        return got

    def build(self, plan: SchedulePlan, kv_slots: list[int] | None = None) -> ModelInputs:
        """Inputs for ``plan``, whose every sequence computes one token and samples after it."""
        seqs, block_tables, bs = plan.seqs, plan.block_tables, self.block_size
        n = len(seqs)
        input_ids, positions, seq_lens, slots = [0] * n, [0] * n, [0] * n, [0] * n
        tables = [block_tables[s.req.seq_id] for s in seqs]
        for i, s in enumerate(seqs):  # one read per sequence; the rest are whole arrays
            req = s.req
            end = s.computed_after if s.computed_after is not None else req.num_computed_tokens + 1
            prompt, pos = req.prompt_token_ids, end - 1
            input_ids[i] = prompt[pos] if pos < len(prompt) else req.output_token_ids[pos - len(prompt)]
            positions[i], seq_lens[i] = pos, end
            slots[i] = tables[i][pos // bs] * bs + pos % bs
        query_start, logits_indices = self._indices(n)
        device = self.device
        meta = AttentionMetadata(
            query_start_loc=query_start,
            seq_lens=_tensor(seq_lens, np.int32, device),
            block_tables=torch.from_numpy(padded_tables(tables)).to(device),
            slot_mapping=_tensor(slots, np.int64, device),
            query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            block_size=bs,
            kv_slots=kv_slots,
        )
        return ModelInputs(
            input_ids=_tensor(input_ids, np.int64, device),
            positions=_tensor(positions, np.int64, device),
            meta=meta,
            logits_indices=logits_indices,
            num_tokens=n,
        )
