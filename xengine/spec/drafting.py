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
from xengine.api.messages import SpecDecodeStatsMsg
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


class BatchProposer(Proposer, Protocol):
    def prepare(self, reqs: list[Request], ks: list[int]) -> None:
        """Draft for these sequences at once (a model's batched steps), before a scheduling pass
        (``ks[i] == 0``: none for that one now)."""
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
    """The proposers that need nothing from the engine (a model proposer is built by the engine)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method {config.method!r} needs the engine to build its proposer")


class Drafter:
    """The scheduler's side of speculative decoding: drafts per sequence, and the counters."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None
    ) -> None:
        """``proposer``: a model proposer built by the engine (default: ``build_proposer(config)``)."""
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else build_proposer(config)
        self.stats = SpecDecodeStats()

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)

    def finish(self, req: Request) -> None:
        """``req`` ended; a draft head first reads the pairs it has left (``HeadProposer.finish``)."""
        finish = getattr(self.proposer, "finish", None)
        if finish is not None:
            finish(req)
        else:
            self.proposer.release(req.seq_id)

    def enabled_for(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return not limit or num_running <= limit

    def may_draft(self, req: Request) -> bool:
        """Whether ``req`` drafts in steps where speculation is on (its params allow it)."""
        return req.params.speculative and not req.params.is_prefill_only

    def prepare(self, running: list[Request], beams: set[str], drafting: bool = True) -> None:
        """Before a scheduling pass: a model proposer drafts for every running sequence that may
        (``beams``: request ids of beam searches). Every sequence that may draft is passed, with
        ``k = 0`` when it does not draft now (``drafting`` False: speculation is off for this pass): an
        MTP head still reads the tokens it computed."""
        prepare = getattr(self.proposer, "prepare", None)
        if prepare is None:
            return
        reqs = [r for r in running if self.may_draft(r) and r.req_id not in beams]
        prepare(reqs, [self._limit(r, False) if drafting else 0 for r in reqs])

    def _limit(self, req: Request, is_beam: bool, budget: int | None = None) -> int:
        """How many tokens ``req`` may draft (0: none), within ``budget`` tokens of the step."""
        if is_beam or req.num_pending_forks or req.params.is_prefill_only or not req.params.speculative:
            return 0
        if req.num_computed_tokens < req.num_prompt_tokens or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        if req.num_placeholders:  # async: its last token is still being sampled
            return 0
        k = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens - 1)
        if budget is not None:
            k = min(k, budget - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
        return max(k, 0)

    def draft(self, req: Request, budget: int, is_beam: bool) -> list[int]:
        """Draft tokens for ``req`` this step (``budget``: the step's tokens left, its own one included)."""
        k = self._limit(req, is_beam, budget)
        return self.proposer.propose(req, k) if k > 0 else []


def spec_stats_msg(drafter: Drafter | None) -> SpecDecodeStatsMsg | None:
    """The drafter's counters as the engine reports them (None: speculative decoding is off)."""
    if drafter is None:
        return None
    st = drafter.stats
    return SpecDecodeStatsMsg(
        method=drafter.config.method,
        num_speculative_tokens=drafter.config.num_speculative_tokens,
        num_drafts=st.num_drafts,
        num_draft_tokens=st.num_draft_tokens,
        num_accepted_tokens=st.num_accepted_tokens,
        accepted_per_pos=list(st.accepted_per_pos),
        acceptance_rate=st.acceptance_rate,
        mean_accepted_length=st.mean_accepted_length,
    )
