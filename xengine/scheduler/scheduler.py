"""Continuous-batching scheduler.

No prefill/decode phases: every sequence has ``num_computed_tokens`` catching up to
``num_tokens`` under one token budget per step. That gives chunked prefill, prefix-cache hits
(``num_computed_tokens`` starts past the cached prefix) and preemption by recompute
(``num_computed_tokens`` goes back to 0). Priority classes are scheduled in order,
``online`` before ``offline``: running online sequences, waiting online ones (which may preempt
offline ones), then running and waiting offline ones. Within a class running sequences go
first (decode-first, stall-free admission). A step with an online prompt chunk takes no offline work
(``isolate_online_prefill``), offline work takes at most ``offline_max_batched_tokens`` of a step, and
a step of only offline work that prefills is ``interruptible``: an online arrival stops it between
layers (``xengine/colocation/``) unless ``offline_preemption: step``.

A beam-search request is one ``BeamGroup``: its root sequence is admitted (and prefilled) like any
other; afterwards its live beams are scheduled together or not at all, since choosing the next
beams needs every beam's candidates. Preempting any beam preempts the group, which restarts from
its prompt (deterministic, so the result is the same).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from memory.kv_cache_manager import ComputedPrefix, KVCacheManager
from xengine.api.config import SchedulerConfig
from xengine.beam.catalog import ItemCatalog
from xengine.beam.group import BeamGroup
from xengine.multimodal.encode_stage import EncodeStage
from xengine.request import PRIORITY_RANK, Request, RequestStatus
from xengine.scheduler.beams import BeamScheduling
from xengine.scheduler.forks import ForkScheduling
from xengine.scheduler.in_flight import advance, done_pending, strip_placeholders
from xengine.scheduler.plan import SampledToken, ScheduledSeq, SchedulePlan, StepOutput
from xengine.scheduler.prompt_outputs import apply_prompt_outputs, limit_prefix, prefill_done
from xengine.scheduler.speculative import SpeculativeScheduling
from xengine.scheduler.stop import check_stop
from xengine.spec.drafting import Drafter

ONLINE = PRIORITY_RANK["online"]


class Scheduler(BeamScheduling, SpeculativeScheduling, ForkScheduling):
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: list[int],
        async_mode: bool = False,
        encode_stage: EncodeStage | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """``drafter``: speculative decoding's drafts (``xengine/spec/``); None: off."""
        self.config = config
        self.drafter = drafter
        self.encode_stage = encode_stage  # vision-language models: images encode in steps of their own
        self.async_mode = async_mode  # plans are advanced when made (``in_flight.py``)
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by rank
        self.running: list[Request] = []
        self.held: set[str] = set()  # sequences of a paused step: not scheduled until it resumes
        self.seqs: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}  # req_id -> seq_ids
        self.updated: dict[str, Request] = {}  # sequences with news for the client
        self.beam_groups: dict[str, BeamGroup] = {}  # req_id -> running beam search
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_computed_prompt_tokens = 0
        # whether a waiting request may be admitted yet (KV tiers: its prompt's blocks still loading)
        self.gates: list[Callable[[Request], bool]] = []

    def hold(self, seq_ids: Iterable[str] = ()) -> None:
        """Keep ``seq_ids`` out of ``schedule`` (the sequences of a paused step, until it carries on:
        ``xengine/colocation/resume.py``), in place of those held so far; none: hold nothing."""
        self.held = set(seq_ids)

    # ------------------------------------------------------------------ admission / abort
    def add(self, req: Request, catalog: ItemCatalog | None = None) -> None:
        """Queue a request; ``catalog`` constrains a beam search to that catalog's items."""
        if req.params.use_beam_search:
            max_new = self.max_model_len - req.num_prompt_tokens
            if req.params.max_tokens is not None:
                max_new = min(max_new, req.params.max_tokens)
            self.beam_groups[req.req_id] = BeamGroup(req, self.eos_token_ids, max_new, catalog)
        else:
            req.num_pending_forks = req.params.n - 1
        self.seqs[req.seq_id] = req
        self.groups.setdefault(req.req_id, []).append(req.seq_id)
        if self.encode_stage is not None:
            self.encode_stage.admit(req)
        self._push_waiting(req)

    def abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._end_request(req_id, "abort")

    def fail_request(self, req_id: str, error: str) -> None:
        """End every sequence of ``req_id`` with finish_reason "error" and ``error`` (e.g. its
        forward raised); its blocks are freed, nothing of it enters the prefix cache."""
        self._end_request(req_id, "error")
        for seq in self.updated.values():
            if seq.req_id == req_id and seq.finish_reason == "error":
                seq.error = error

    def _end_request(self, req_id: str, finish_reason: str) -> None:
        if req_id in self.beam_groups:
            self._finish_beam_group(self.beam_groups[req_id], finish_reason)
            return
        for seq_id in list(self.groups.get(req_id, [])):
            req = self.seqs.get(seq_id)
            if req is not None and not req.is_finished:
                self._finish(req, finish_reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _push_waiting(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        keys = [r.rank for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, req.rank), req)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        self._budget = self.config.max_num_batched_tokens
        self._scheduled: set[str] = set()
        self._online_prefill = False
        self._prefill_cap = self._mixed_prefill_cap()
        self._prefill_tokens = 0
        self._num_decode_only = 0  # sequences of the plan that compute one token and sample one
        self._num_tokens = self._num_forking = 0  # the plan's tokens; its sequences sampling n > 1
        self._context_tokens = 0  # the sum of its sequences' lengths once it ran
        self._start_drafting()
        self.running.sort(key=lambda r: r.rank)
        for cls in sorted(PRIORITY_RANK.values()):
            if cls > ONLINE and self._online_prefill and self.config.isolate_online_prefill:
                break  # an online prompt chunk runs in a step of online work only
            if cls > ONLINE and self.config.offline_max_batched_tokens:
                self._budget = min(self._budget, self.config.offline_max_batched_tokens)
            self._schedule_running(cls, plan)
            self._admit_waiting(cls, plan)
        if self.encode_stage is not None:  # Algorithm 1: encodes only in a step without a prefill chunk
            plan.encodes = self.encode_stage.select(self.waiting, self._prefill_tokens > 0)
        plan.block_tables = {s.req.seq_id: self.kv.get_block_table(s.req.seq_id) for s in plan.seqs}
        plan.block_copies = self.kv.take_pending_copies()
        window = self.kv.window
        if window is not None:  # the sliding-window layers' own tables (``memory/sliding_window.py``)
            plan.window_block_tables = {s.req.seq_id: window.tables[s.req.seq_id] for s in plan.seqs}
            plan.window_block_copies = window.take_pending_copies()
        states = self.kv.states
        if states is not None:  # recurrent layers' slots (``memory/recurrent_state.py``)
            plan.state_slots = {s.req.seq_id: states.slot_of[s.req.seq_id] for s in plan.seqs}
            plan.state_checkpoints, plan.state_copies = states.take_step()
        # counted while planning (``_add_to_plan``): no further pass over the sequences per step
        plan.num_batched_tokens = self._num_tokens
        plan.decode_only = bool(plan.seqs) and self._num_decode_only == len(plan.seqs)
        plan.context_tokens = self._context_tokens
        plan.sync = self._num_forking > 0 or (
            bool(self.beam_groups) and any(s.req.req_id in self.beam_groups for s in plan.seqs)
        )
        plan.sync = plan.sync or self._drafts_need_sync(plan)
        plan.interruptible = (  # an offline-only step with a prompt chunk
            self._prefill_tokens > 0 and all(s.req.rank[0] > ONLINE for s in plan.seqs)
        )
        if self.async_mode and not plan.sync:
            advance(plan)
        return plan

    def _mixed_prefill_cap(self) -> int:
        """``mixed_prefill_tokens`` while some running sequence decodes (0: no cap this step)."""
        cap = self.config.mixed_prefill_tokens
        if not cap or not self.config.enable_chunked_prefill:
            return 0
        decoding = any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        return cap if decoding else 0

    def _num_new_tokens(self, req: Request, num_computed: int) -> int:
        num_new = req.num_tokens - num_computed
        if num_new > self._budget and not self.config.enable_chunked_prefill:
            return 0
        num_new = min(num_new, self._budget)
        if self._prefill_cap and (num_new > 1 or num_computed < req.num_prompt_tokens):
            if self._prefill_tokens == 0:  # the step's first prompt chunk: up to the cap
                return min(num_new, self._prefill_cap)
            if num_new > self._prefill_cap - self._prefill_tokens:  # further prompts only whole
                return 0
        return num_new

    def _schedule_running(self, cls: int, plan: SchedulePlan) -> None:
        scheduled, held, beam_groups = self._scheduled, self.held, self.beam_groups
        for req in list(self.running):  # per step and sequence: kept to plain lookups
            if self._budget <= 0:
                return
            if PRIORITY_RANK[req.priority] != cls or req.status != RequestStatus.RUNNING:
                continue
            if req.seq_id in scheduled or req.seq_id in held:  # held: in a paused step (``hold``)
                continue
            if req.num_placeholders and done_pending(req, self.max_model_len):  # its in-flight token ends it
                continue
            group = beam_groups.get(req.req_id) if beam_groups else None
            if group is not None and len(group.slots) > 1:
                self._schedule_beams(group, plan)
                continue
            num_new = self._num_new_tokens(req, req.num_computed_tokens)
            if num_new <= 0:
                continue
            drafts = self._drafts_for(req) if num_new == 1 and self._drafting else []
            num_new += len(drafts)
            while not self.kv.allocate_slots(
                req.seq_id, req.num_computed_tokens + num_new, num_computed=req.num_computed_tokens
            ):
                victim = self._pick_victim(exclude=req.req_id, max_rank=None)
                if victim is None:
                    self._preempt(req, plan)
                    break
                self._preempt(victim, plan)
            else:
                if drafts and not self._draft_states(req, drafts):
                    num_new, drafts = 1, []
                self._add_to_plan(plan, req, num_new, drafts)

    def _admit_waiting(self, cls: int, plan: SchedulePlan) -> None:
        while self.waiting and self._budget > 0:
            req = self.next_waiting()
            if req is None or req.rank[0] != cls:
                return
            if len(self.running) >= self.config.max_num_seqs:
                if not self._preempt_lower_class(cls, plan):
                    return
                continue
            prefix = ComputedPrefix([], 0)
            if req.num_computed_tokens == 0:
                prefix = self.kv.get_computed_prefix(req.cache_token_ids)
                prefix = self.kv.usable_prefix(limit_prefix(req, prefix, self.kv.block_size))
            num_computed = max(req.num_computed_tokens, prefix.num_tokens)
            num_new = self._num_new_tokens(req, num_computed)
            if num_new <= 0:
                return
            if not self.kv.allocate_slots(req.seq_id, num_computed + num_new, prefix, num_computed):
                if not self._preempt_lower_class(cls, plan):
                    return
                continue
            self.waiting.remove(req)
            if not req.admitted_once:
                req.admitted_once = True
                req.queue_time_s = time.monotonic() - req.received_at
                req.num_cached_tokens = prefix.num_tokens
                self.prefix_queries += req.num_prompt_tokens
                self.prefix_hits += prefix.num_tokens
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_to_plan(plan, req, num_new)

    def next_waiting(self) -> Request | None:
        """The first waiting request past the encode stage and every gate (rank order)."""
        if self.encode_stage is None and not self.gates:
            return self.waiting[0] if self.waiting else None
        stage = self.encode_stage
        return next(
            (r for r in self.waiting if (stage is None or stage.ready(r)) and all(g(r) for g in self.gates)),
            None,
        )

    def _add_to_plan(
        self, plan: SchedulePlan, req: Request, num_new: int, drafts: list[int] | None = None
    ) -> None:
        num_known = num_new - len(drafts) if drafts else num_new  # the drafts come after the known tokens
        num_computed, num_prompt = req.num_computed_tokens, len(req.prompt_token_ids)
        sample = (
            num_computed + num_known == num_prompt + len(req.output_token_ids)
            and not req.params.is_prefill_only
        )
        num_samples = 1 + req.num_pending_forks if sample else 1
        seq = ScheduledSeq(req, num_new, sample, num_samples, draft_token_ids=drafts or ())
        prefill = (
            num_new > 1 or num_computed < num_prompt
        )  # a prompt chunk or recomputation, not one decode token
        if prefill and PRIORITY_RANK[req.priority] == ONLINE:
            self._online_prefill = True
        group = self.beam_groups.get(req.req_id) if self.beam_groups else None
        if group is not None and sample:
            seq.num_beam_candidates = group.num_candidates
            seq.banned_token_ids = group.banned_token_ids(req)
            seq.allowed_token_ids = group.allowed_token_ids(req)
        plan.seqs.append(seq)
        self._scheduled.add(req.seq_id)
        self._budget -= num_new
        self._num_tokens += num_new
        self._context_tokens += num_computed + num_new
        if num_samples > 1:
            self._num_forking += 1
        if prefill:
            self._prefill_tokens += num_new
        elif sample and num_samples == 1 and group is None:  # one known token, not a prompt's: no drafts
            self._num_decode_only += 1

    # ------------------------------------------------------------------ preemption
    def _pick_victim(self, exclude: str | None, max_rank: int | None) -> Request | None:
        """Lowest-priority, newest running sequence not scheduled this step, not of request ``exclude``."""
        for req in reversed(self.running):
            if req.req_id == exclude or req.seq_id in self._scheduled:
                continue
            if max_rank is not None and req.rank[0] <= max_rank:
                return None
            return req
        return None

    def _preempt_lower_class(self, cls: int, plan: SchedulePlan) -> bool:
        victim = self._pick_victim(exclude=None, max_rank=cls)
        if victim is None:
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, req: Request, plan: SchedulePlan) -> None:
        """Preempt by recompute: drop its KV; it restarts from the prefix cache / scratch."""
        group = self.beam_groups.get(req.req_id)
        if group is not None:
            self._preempt_beams(group, plan)
            return
        self.running.remove(req)
        self.kv.free(req.seq_id)
        if self.drafter is not None:  # a draft model's KV goes with the target's
            self.drafter.release(req.seq_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted_seq_ids.append(req.seq_id)
        self._push_waiting(req)

    # ------------------------------------------------------------------ update
    def update(self, plan: SchedulePlan, out: StepOutput) -> None:
        stepped: dict[str, int] = {}  # beam groups that got candidates: req_id -> epoch
        for req in EncodeStage.applied(plan.encodes):  # encode-only requests (EPD) end here
            if not req.is_finished:
                self._finish(req, "encoded")
        prompt_outputs, beam_groups = bool(out.prompt_logprobs or out.embeddings), self.beam_groups
        tokens = out.token_ids  # the common step: one token per sequence, nothing else
        for s in plan.seqs:
            req = s.req
            if s.computed_after is not None:  # advanced when scheduled (async)
                self._update_advanced(s, out)
                continue
            if req.status != RequestStatus.RUNNING:
                continue  # finished (e.g. aborted) while the step ran
            if s.draft_token_ids:
                self._update_drafted(s, out.sampled[req.seq_id])
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens += s.num_new_tokens
            num_prompt = len(req.prompt_token_ids)
            if before < num_prompt:
                self.num_computed_prompt_tokens += min(req.num_computed_tokens, num_prompt) - before
            # cache before sampling: a request that finishes now still leaves its prefix behind
            # (the token list is built only when a block filled: not every step of every request)
            if self.kv.has_blocks_to_cache(req.seq_id, req.num_computed_tokens):
                self.kv.cache_blocks(req.seq_id, req.cache_token_ids, req.num_computed_tokens)
            if prompt_outputs and apply_prompt_outputs(req, out):
                self.updated[req.seq_id] = req
            if s.sample and beam_groups and req.req_id in beam_groups:
                stepped[req.req_id] = beam_groups[req.req_id].epoch
            elif s.sample and tokens is not None:
                self._append_token_id(req, tokens[req.seq_id])
            elif s.sample:
                self._apply_samples(req, out.sampled[req.seq_id])
            elif prefill_done(req, req.num_computed_tokens):
                self._finish(req, "length")
        for req_id, epoch in stepped.items():
            group = self.beam_groups.get(req_id)
            if group is not None and group.epoch == epoch:  # not aborted / preempted meanwhile
                self._advance_beams(group, plan, out)

    def _update_advanced(self, s: ScheduledSeq, out: StepOutput) -> None:
        """Apply a step whose requests were advanced at schedule time: cache its full blocks and put
        the sampled token where its placeholder is. A request preempted meanwhile still takes its
        token (it was computed before its KV was dropped); a finished one takes nothing."""
        req = s.req
        if req.is_finished:
            return
        assert s.computed_after is not None
        before = s.computed_after - s.num_new_tokens
        self.num_computed_prompt_tokens += max(0, min(s.computed_after, req.num_prompt_tokens) - before)
        if (
            req.status == RequestStatus.RUNNING
            and req.num_computed_tokens >= s.computed_after
            and self.kv.has_blocks_to_cache(req.seq_id, s.computed_after)
        ):
            self.kv.cache_blocks(req.seq_id, req.cache_token_ids, s.computed_after)
        if apply_prompt_outputs(req, out):
            self.updated[req.seq_id] = req
        if s.output_index is None:
            if prefill_done(req, s.computed_after):
                self._finish(req, "length")
            return
        tokens = out.token_ids
        sample = SampledToken(tokens[req.seq_id]) if tokens is not None else out.sampled[req.seq_id][0]
        req.output_token_ids[s.output_index] = sample.token_id
        req.num_placeholders -= 1
        self._append_token(req, sample, num_output=s.output_index + 1)

    def _append_token(self, req: Request, sample: SampledToken, num_output: int | None = None) -> None:
        """Report a sampled token (appended, or already in place at ``num_output - 1``); stop checks."""
        if sample.logprob is not None:
            req.new_logprobs.append(sample.logprob)
            req.new_top_logprobs.append(sample.top_logprobs or [])
        self._append_token_id(req, sample.token_id, num_output)

    def _append_token_id(self, req: Request, token_id: int, num_output: int | None = None) -> None:
        if num_output is None:
            req.output_token_ids.append(token_id)
        req.new_token_ids.append(token_id)
        self.updated[req.seq_id] = req
        reason = check_stop(req, token_id, self.eos_token_ids, self.max_model_len, num_output)
        if reason is not None:
            self._finish(req, *reason)

    def _finish(self, req: Request, finish_reason: str, stop_reason: int | str | None = None) -> None:
        if req.req_id in self.beam_groups:
            self._finish_beam_group(self.beam_groups[req.req_id], finish_reason)
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req.seq_id)
        if self.drafter is not None:
            self.drafter.finish(req)
        strip_placeholders(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = finish_reason
        req.stop_reason = stop_reason
        self.updated[req.seq_id] = req
        if req.num_pending_forks:  # ended before forking: its n - 1 siblings end with it, empty
            for index in range(1, req.num_pending_forks + 1):
                sibling = self._sibling(
                    req, index, status=RequestStatus.FINISHED, finish_reason=finish_reason
                )
                self.updated[sibling.seq_id] = sibling
            req.num_pending_forks = 0

    def fail(self, req: Request, finish_reason: str) -> None:
        """End ``req`` (and its beam group) now, e.g. when it can never be scheduled."""
        self._finish(req, finish_reason)

    def take_updated(self) -> list[Request]:
        """Sequences with news since the last call; forgets fully finished requests."""
        out = list(self.updated.values())
        self.updated.clear()
        for req in out:
            if req.is_finished:
                self.seqs.pop(req.seq_id, None)
                group = self.groups.get(req.req_id)
                if group is not None and all(self.seqs.get(s) is None for s in group):
                    del self.groups[req.req_id]
        return out
