"""Which sequences draft in a step, how many tokens, and from which proposer (scheduler side).

A running sequence drafts when it decodes (its prompt is computed and exactly one token waits to be
computed) and nothing about it needs a token at a time: not a beam search, not an ``n > 1`` request
still to fork, not prefill-only, not opted out (``SamplingParams.speculative`` false). A sequence with a grammar drafts too: the runner keeps the drafts the
grammar accepts (``BaseGrammarMatcher.valid_prefix``) and masks each verification row with the
grammar's state after the drafts before it.
Its draft is at most ``num_speculative_tokens`` long and leaves room for the step's own token within
the step's token budget, ``max_tokens`` and ``max_model_len``. While more sequences run than
``disable_by_batch_size`` (when set), nobody drafts: a big batch already fills the step.

Under async scheduling a sequence drafts only once its last token is known (no placeholder), and a
plan in which any sequence may draft is ``sync`` (``Scheduler.schedule``): the next plan is made after
its outputs are applied, so the next drafts see them. While speculation is off for the batch
(``disable_by_batch_size``) or every sequence opted out, steps overlap as usual.
"""

from __future__ import annotations

from typing import Protocol

from xengine.api.config import SpeculativeConfig
from xengine.request import Request
from xengine.spec.ngram import NgramIndex
from xengine.spec.stats import SpecDecodeStats


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``req``'s tokens."""
        ...

    def release(self, seq_id: str) -> None:
        """Forget what was kept for a sequence that ended."""
        ...


class NgramProposer:
    """Prompt lookup with an index per sequence (``NgramIndex``), dropped when the sequence ends."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        index = self.indexes.get(req.seq_id)
        if index is None:
            index = self.indexes[req.seq_id] = NgramIndex(self.min_n, self.max_n)
        return index.draft(req.all_token_ids, k)

    def release(self, seq_id: str) -> None:
        self.indexes.pop(seq_id, None)


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method {config.method!r} is not implemented yet")


class Drafter:
    """The scheduler's side of speculative decoding: drafts per sequence, and the counters."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = build_proposer(config)
        self.stats = SpecDecodeStats()

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)

    def enabled_for(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return not limit or num_running <= limit

    def may_draft(self, req: Request) -> bool:
        """Whether ``req`` drafts in steps where speculation is on (its params allow it)."""
        return req.params.speculative and not req.params.is_prefill_only

    def draft(self, req: Request, budget: int, is_beam: bool) -> list[int]:
        """Draft tokens for ``req`` this step (``budget``: the step's tokens left, its own one included)."""
        if is_beam or req.num_pending_forks or req.params.is_prefill_only or not req.params.speculative:
            return []
        if req.num_computed_tokens < req.num_prompt_tokens or req.num_tokens - req.num_computed_tokens != 1:
            return []
        if req.num_placeholders:  # async: its last token is still being sampled
            return []
        k = min(self.config.num_speculative_tokens, budget - 1, self.max_model_len - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
        if k <= 0:
            return []
        return self.proposer.propose(req, k)
