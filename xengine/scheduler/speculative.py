"""Speculative decoding inside the scheduler: which sequences draft this step, the draft tokens
scheduled after their last token (``ScheduledSeq.draft_token_ids``), and applying a step that verified
them. ``xengine/spec/`` holds the proposers and the verification; ``docs/speculative_decoding.md`` the
whole story.

A mixin of ``Scheduler`` (``scheduler.py``), like ``beams.py``: it uses the scheduler's KV manager,
drafter and queues.
"""

from __future__ import annotations

from memory.kv_cache_manager import KVCacheManager
from xengine.beam.group import BeamGroup
from xengine.request import Request, RequestStatus
from xengine.scheduler.plan import SampledToken, ScheduledSeq, SchedulePlan
from xengine.spec.drafting import Drafter


class SpeculativeScheduling:
    kv: KVCacheManager
    running: list[Request]
    held: set[str]
    beam_groups: dict[str, BeamGroup]
    async_mode: bool
    drafter: Drafter | None
    _budget: int
    _drafting: bool

    # provided by ``Scheduler``
    def _append_token(self, req: Request, sample: SampledToken, num_output: int | None = None) -> None:
        raise NotImplementedError

    def _start_drafting(self) -> None:
        """At the start of a scheduling pass: whether sequences draft in it, and a model proposer's
        drafts for the whole batch at once."""
        self._drafting = self.drafter is not None and self.drafter.enabled_for(len(self.running))
        if self.drafter is not None:
            running = [
                r for r in self.running if r.status == RequestStatus.RUNNING and r.seq_id not in self.held
            ]
            self.drafter.prepare(running, set(self.beam_groups), self._drafting)

    def _drafts_for(self, req: Request) -> list[int]:
        """A decoding sequence's drafts this step (within what is left of the step's budget)."""
        if not self._drafting:
            return []
        assert self.drafter is not None
        return self.drafter.draft(req, self._budget, req.req_id in self.beam_groups)

    def _draft_states(self, req: Request, drafts: list[int]) -> bool:
        """Recurrent layers: a state slot per draft (``RecurrentStateSlots.plan_drafts``); False when
        none are left (never with a set per running sequence): the sequence does not draft then."""
        states = self.kv.states
        return states is None or states.plan_drafts(req.seq_id, req.num_computed_tokens, len(drafts))

    def _drafts_need_sync(self, plan: SchedulePlan) -> bool:
        """Async scheduling: a plan in which a sequence may draft is applied before the next is made
        (the next drafts need its tokens; ``spec/drafting.py``)."""
        if not (self._drafting and self.async_mode):
            return False
        assert self.drafter is not None
        return any(s.sample and self.drafter.may_draft(s.req) for s in plan.seqs)

    def _update_drafted(self, s: ScheduledSeq, samples: list[SampledToken]) -> None:
        """Apply a step that verified drafts: the accepted drafts and one more token were emitted
        (``samples``); the KV of the sequence's last token and the accepted drafts is kept, the blocks
        that only rejected drafts reached go back to the pool."""
        req = s.req
        drafts = s.draft_token_ids
        accepted = len(samples) - 1
        assert 0 <= accepted <= len(drafts) and [x.token_id for x in samples[:accepted]] == drafts[:accepted]
        assert self.drafter is not None
        self.drafter.stats.record(len(drafts), accepted)
        req.num_computed_tokens += 1 + accepted
        self.kv.trim(req.seq_id, req.num_computed_tokens + 1)
        if self.kv.states is not None:  # recurrent layers: the state after the last accepted token
            self.kv.states.accept_drafts(req.seq_id, accepted)
        if self.kv.has_blocks_to_cache(req.seq_id, req.num_computed_tokens):
            self.kv.cache_blocks(req.seq_id, req.cache_token_ids + drafts[:accepted], req.num_computed_tokens)
        for sample in samples:
            self._append_token(req, sample)
            if req.is_finished:  # a stop among the accepted tokens: what follows it is dropped
                break
