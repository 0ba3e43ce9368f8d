"""Interrupted offline steps carry on from where they stopped, instead of being computed again.

When an online arrival stopped a step at a resumable point (``layer_checks.py``), the normal loop
keeps the step here, paused, with the hidden states at that point. Its sequences are held out of
scheduling, the online prefill runs, and as soon as no online prefill is pending the step's forward
carries on from the point: the same operations on the same tensors, so the tokens are bit for bit
those of a step never stopped. A paused step is dropped (its sequences run again from where they
were) when one of its sequences moved meanwhile, or after ``MAX_WAIT_STEPS`` steps of waiting.
See ``docs/colocation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from graph.interrupt import ResumePoint, StepInterrupted
from xengine.request import RequestStatus
from xengine.scheduler.plan import SchedulePlan
from xengine.scheduler.scheduler import ONLINE, Scheduler

MAX_WAIT_STEPS = 64  # a paused step still waiting after this many steps is dropped (run again)


@dataclass
class PausedStep:
    plan: SchedulePlan
    step: object  # the model runner's PreparedStep
    point: ResumePoint
    computed: dict[str, int]  # seq id -> its num_computed_tokens when the step was scheduled
    waited: int = 0  # engine steps it has waited for online prefills


class StepResumer:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.paused: PausedStep | None = None
        self.num_resumed = 0  # paused steps carried on to their end
        self.num_dropped = 0  # paused steps given up (a sequence moved): computed again

    def pause(self, plan: SchedulePlan, stop: StepInterrupted) -> bool:
        """Keep ``plan``'s step when ``stop`` says where to carry on from; False: it runs again."""
        self.paused = None
        if stop.resume is None or stop.step is None:
            self.scheduler.hold()
            return False
        computed = {s.req.seq_id: s.req.num_computed_tokens for s in plan.seqs}
        self.paused = PausedStep(plan, stop.step, stop.resume, computed)
        self.scheduler.hold(computed)
        return True

    def ready(self, online_pending: int) -> PausedStep | None:
        """The paused step, when it can carry on now: its sequences where they were and no online
        prefill waiting or in progress (``online_pending``: arrivals read, not yet in the engine)."""
        paused = self.paused
        if paused is None:
            return None
        for s in paused.plan.seqs:
            req = s.req
            if req.status != RequestStatus.RUNNING or req.num_computed_tokens != paused.computed[req.seq_id]:
                self.drop()
                return None
        if online_pending or self._online_prefill():
            paused.waited += 1
            if paused.waited > MAX_WAIT_STEPS:  # never leave its sequences held for long
                self.drop()
            return None
        return paused

    def resumed(self) -> None:
        """The paused step ran to its end."""
        self.paused = None
        self.scheduler.hold()
        self.num_resumed += 1

    def drop(self) -> None:
        """Give the paused step up: its sequences run again from where they were."""
        self.paused = None
        self.scheduler.hold()
        self.num_dropped += 1

    def _online_prefill(self) -> bool:
        s = self.scheduler
        if any(r.rank[0] == ONLINE for r in s.waiting):
            return True
        return any(r.rank[0] == ONLINE and r.num_computed_tokens < r.num_prompt_tokens for r in s.running)
