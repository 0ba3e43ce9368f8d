"""Beam search inside the scheduler: a ``BeamGroup``'s live beams are scheduled together or not at all
(choosing the next beams needs every beam's candidates), advanced from their candidates after a
step, preempted as a group (the group restarts from its prompt; deterministic, so the result is the
same) and published as ``n`` finished sequences when the search ends.

A mixin of ``Scheduler`` (``scheduler.py``): it uses the scheduler's queues, KV manager and
preemption, and the scheduler calls into it wherever a sequence belongs to a beam group.
"""

from __future__ import annotations

from memory.kv_cache_manager import KVCacheManager
from xengine.beam.group import BeamGroup
from xengine.request import Request, RequestStatus
from xengine.scheduler.plan import SchedulePlan, StepOutput


class BeamScheduling:
    kv: KVCacheManager
    waiting: list[Request]
    running: list[Request]
    seqs: dict[str, Request]
    groups: dict[str, list[str]]
    updated: dict[str, Request]
    beam_groups: dict[str, BeamGroup]
    num_preemptions: int
    _budget: int

    # provided by ``Scheduler``
    def _add_to_plan(self, plan: SchedulePlan, req: Request, num_new: int) -> None:
        raise NotImplementedError

    def _pick_victim(self, exclude: str | None, max_rank: int | None) -> Request | None:
        raise NotImplementedError

    def _preempt(self, req: Request, plan: SchedulePlan) -> None:
        raise NotImplementedError

    def _push_waiting(self, req: Request) -> None:
        raise NotImplementedError

    def _schedule_beams(self, group: BeamGroup, plan: SchedulePlan) -> None:
        """All live beams of ``group`` (one new token each) or none of them."""
        beams = group.slots
        if len(beams) > self._budget:
            return
        for beam in beams:
            while not self.kv.allocate_slots(
                beam.seq_id, beam.num_tokens, num_computed=beam.num_computed_tokens
            ):
                victim = self._pick_victim(exclude=group.req_id, max_rank=None)
                if victim is None:
                    self._preempt(beam, plan)
                    return
                self._preempt(victim, plan)
        for beam in beams:
            self._add_to_plan(plan, beam, beam.num_tokens - beam.num_computed_tokens)

    def _preempt_beams(self, group: BeamGroup, plan: SchedulePlan) -> None:
        self._drop_beams(group, plan)
        root = group.reset()
        root.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(root)

    def _drop_beams(self, group: BeamGroup, plan: SchedulePlan | None) -> None:
        for beam in group.slots:
            if beam.status == RequestStatus.RUNNING:
                self.running.remove(beam)
            elif beam.status == RequestStatus.WAITING:
                self.waiting.remove(beam)
            self.kv.free(beam.seq_id)
            beam.status = RequestStatus.FINISHED
            if plan is not None:
                plan.preempted_seq_ids.append(beam.seq_id)

    def _advance_beams(self, group: BeamGroup, plan: SchedulePlan, out: StepOutput) -> None:
        cands = [out.beam_candidates[b.seq_id] for b in group.slots]
        step = group.advance([c[0] for c in cands], [c[1] for c in cands])
        if step.done:
            self._finish_beam_group(group, None)
            return
        for beam in step.dropped:
            self.running.remove(beam)
            self.kv.free(beam.seq_id)
            beam.status = RequestStatus.FINISHED
        for parent, child in step.forks:
            # full blocks are shared, the partial last block is copied on write
            while not self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens):
                victim = self._pick_victim(exclude=group.req_id, max_rank=None)
                if victim is None:
                    self._preempt_beams(group, plan)
                    return
                self._preempt(victim, plan)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)

    def _finish_beam_group(self, group: BeamGroup, reason: str | None) -> None:
        """Free every beam and publish the results (``reason`` None: the search completed)."""
        self._drop_beams(group, None)
        del self.beam_groups[group.req_id]
        self.seqs.pop(group.root.seq_id, None)
        hyps = group.results() if reason is None else []
        results = []
        for i in range(group.root.params.n):
            out = Request(
                seq_id=f"{group.req_id}#out{i}",
                req_id=group.req_id,
                index=i,
                prompt_token_ids=group.root.prompt_token_ids,
                params=group.root.params,
                num_cached_tokens=group.root.num_cached_tokens,
                status=RequestStatus.FINISHED,
                finish_reason=reason or "length",
            )
            if i < len(hyps):
                hyp = hyps[i]
                out.output_token_ids, out.new_token_ids = list(hyp.token_ids), list(hyp.token_ids)
                out.beam_score, out.cumulative_logprob = hyp.score, hyp.cumulative_logprob
                if hyp.finished_by_stop:
                    last = hyp.token_ids[-1]
                    out.finish_reason = "stop"
                    out.stop_reason = last if last in group.root.params.stop_token_ids else None
            results.append(out)
            self.seqs[out.seq_id] = out
            self.updated[out.seq_id] = out
        self.groups[group.req_id] = [r.seq_id for r in results]
