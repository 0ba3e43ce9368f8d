"""Counters of speculative decoding, named as vLLM's metrics (``vllm:spec_decode_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Totals since start: drafts (sequence-steps that proposed), tokens proposed and accepted, and
    acceptances per draft position (position 0: the first draft token of a step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    proposed_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's step: ``num_drafted`` tokens proposed, the first ``num_accepted`` accepted."""
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        grow = num_drafted - len(self.proposed_per_pos)
        if grow > 0:
            self.proposed_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for pos in range(num_drafted):
            self.proposed_per_pos[pos] += 1
            self.accepted_per_pos[pos] += int(pos < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per drafting sequence-step: the accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_per_pos(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_pos, self.proposed_per_pos)]
