"""The previous step's sampling rows, reused while the batch is the same (a persistent batch).

Most decode steps sample the same sequences as the step before, in the same order, with the same
parameters: their sampling metadata (temperatures, top-k / top-p tensors, biases, generators) is the
same too. Rebuilding it costs more per step than anything else the runner does on the host, so a
step whose sampling rows are the previous step's sequences reuses that step's ``SamplingRows``.

Only metadata that does not change from step to step is reused: a batch whose rows read their token
history (penalties, bad words), ban ids until ``min_tokens``, follow a grammar, fork (``n > 1``) or
search beams is built afresh every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xengine.scheduler.plan import SchedulePlan

if TYPE_CHECKING:
    from xengine.request import Request


class SamplingReuse:
    """Holds the last reusable step's rows and the sequences they were built for."""

    def __init__(self) -> None:
        self._reqs: list[Request] = []
        self._rows: Any = None  # model_runner.SamplingRows
        self.num_reused = 0  # steps that reused the previous step's rows

    def get(self, plan: SchedulePlan) -> Any:
        """The previous rows when ``plan`` samples exactly the same sequences in the same order (one
        token each); None otherwise."""
        reqs, seqs = self._reqs, plan.seqs
        if self._rows is None or len(seqs) != len(reqs):
            return None
        for s, req in zip(seqs, reqs):
            if s.req is not req or not s.sample or s.num_samples != 1 or s.draft_token_ids:
                return None
        self.num_reused += 1
        return self._rows

    def keep(self, plan: SchedulePlan, rows: Any) -> None:
        """Remember ``rows`` (built for ``plan``) when nothing in them changes from step to step."""
        meta = rows.meta if rows is not None else None
        static = (
            meta is not None
            and not rows.beam_seq_ids
            and not rows.grammar.rows
            and meta.banned_token_ids is None
            and not meta.needs_history
            and len(rows.rows) == len(plan.seqs)
            and all(s.sample and s.num_samples == 1 and not s.draft_token_ids for s in plan.seqs)
        )
        self._reqs = [s.req for s in plan.seqs] if static else []
        self._rows = rows if static else None
