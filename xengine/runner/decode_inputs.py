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


def _on(values: list[int], dtype: type, device: torch.device) -> torch.Tensor:
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
        # two flat lists, two conversions (each costs most on first touch after a forward): int64
        # positions | input ids | slots (positions at offset 0: compiled graphs take them), int32
        # seq lens | block tables row by row
        longs, ints = [0] * (3 * n), [0] * n
        tables = [block_tables[s.req.seq_id] for s in seqs]
        for i, s in enumerate(seqs):  # one read per sequence; the rest are whole arrays
            req = s.req
            end = s.computed_after if s.computed_after is not None else req.num_computed_tokens + 1
            prompt, pos = req.prompt_token_ids, end - 1
            longs[n + i] = prompt[pos] if pos < len(prompt) else req.output_token_ids[pos - len(prompt)]
            longs[i], ints[i] = pos, end
            longs[2 * n + i] = tables[i][pos // bs] * bs + pos % bs
        seq_lens = ints[:]
        width = max(map(len, tables))
        for t in tables:
            ints += t
            if len(t) < width:
                ints += [0] * (width - len(t))
        device = self.device
        as_long, as_int = _on(longs, np.int64, device), _on(ints, np.int32, device)
        query_start, logits_indices = self._indices(n)
        meta = AttentionMetadata(
            query_start_loc=query_start,
            seq_lens=as_int[:n],
            block_tables=as_int[n:].view(n, width),
            slot_mapping=as_long[2 * n :],
            query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            block_size=bs,
            kv_slots=kv_slots,
        )
        return ModelInputs(
            input_ids=as_long[n : 2 * n],
            positions=as_long[:n],
            meta=meta,
            logits_indices=logits_indices,
            num_tokens=n,
        )
