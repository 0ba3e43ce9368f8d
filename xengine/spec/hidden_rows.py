"""The target's final hidden states an MTP head still has to read, per sequence (``mtp.py``).

The runner puts each step's rows (``put_step``) and the proposer takes them before it drafts. Only rows
of positions that stay are kept: a verification step's rows end at its last accepted draft (the rows of
rejected drafts are never put), so every row held is the hidden state of a token the sequence keeps. A
sequence's rows are contiguous; a step's rows that do not continue them (after a preemption: the
sequence starts again) replace them.

The runner may run on another thread than the proposer (async scheduling): one lock guards the rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xengine.scheduler.plan import SchedulePlan, StepOutput


@dataclass
class _Rows:
    start: int  # the position of the first row
    rows: list[torch.Tensor]  # [n, hidden] pieces, in order

    @property
    def end(self) -> int:
        return self.start + sum(r.shape[0] for r in self.rows)


class HiddenRows:
    def __init__(self, source: Callable[[], torch.Tensor | None] | None = None) -> None:
        """``source``: where a step's rows come from instead of the target's final hidden states (EAGLE-3:
        the layers the model captured; None when a forward did not capture them all)."""
        self._lock = threading.Lock()
        self._seqs: dict[str, _Rows] = {}
        self.source = source

    def put_step(self, plan: SchedulePlan, hidden: torch.Tensor, out: StepOutput) -> None:
        """Keep the rows of ``plan``'s sequences that draft (``out``: the step's emitted tokens)."""
        if self.source is not None:
            captured = self.source()
            if captured is None:
                return  # the sequences' rows have a gap now: they stop drafting
            hidden = captured
        offset = 0
        with self._lock:
            for s in plan.seqs:
                n, first = s.num_new_tokens, offset
                offset += n
                params = s.req.params
                if (
                    not params.speculative
                    or params.is_prefill_only
                    or s.num_beam_candidates
                    or s.num_samples > 1
                ):
                    continue
                if s.draft_token_ids:  # the last token and the accepted drafts
                    n = n - len(s.draft_token_ids) + len(out.sampled.get(s.req.seq_id, [None])) - 1
                rows = hidden[first : first + n].clone()
                held = self._seqs.get(s.req.seq_id)
                if held is not None and held.end == s.start:
                    held.rows.append(rows)
                else:
                    self._seqs[s.req.seq_id] = _Rows(s.start, [rows])

    def take(self, seq_id: str, start: int, end: int, keep_from: int | None = None) -> torch.Tensor | None:
        """Rows ``start..end`` of ``seq_id``, or None if any is missing. The rows before ``keep_from``
        (default ``end - 1``: a draft from the same tokens again reads the last) are dropped."""
        keep_from = end - 1 if keep_from is None else keep_from
        with self._lock:
            held = self._seqs.get(seq_id)
            if held is None or held.start > start or held.end < end or start >= end or keep_from < start:
                return None
            rows = torch.cat(held.rows) if len(held.rows) > 1 else held.rows[0]
            taken = rows[start - held.start : end - held.start]
            self._seqs[seq_id] = _Rows(keep_from, [rows[keep_from - held.start :]])
            return taken

    def available(self, seq_id: str) -> tuple[int, int] | None:
        """``(start, end)`` of the rows held for ``seq_id``."""
        with self._lock:
            held = self._seqs.get(seq_id)
            return None if held is None else (held.start, held.end)

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._seqs.pop(seq_id, None)

    def keep_only(self, seq_ids: set[str]) -> None:
        """Drop the rows of every other sequence (they do not draft: nobody reads them)."""
        with self._lock:
            for seq_id in [s for s in self._seqs if s not in seq_ids]:
                del self._seqs[seq_id]
