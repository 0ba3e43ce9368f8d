"""The normal loop: schedule -> execute -> update, one step at a time on the engine thread.

A step an online arrival stopped (co-location) applies nothing; when it stopped at a resumable point
it is kept and carries on, as soon as no online prefill waits, in place of a newly scheduled step
(``xengine/colocation/resume.py``). ``docs/engine_performance.md`` compares this loop with the
overlapped one.
"""

from __future__ import annotations

import logging
import time

from graph.interrupt import StepInterrupted
from xengine.colocation.interrupter import Interrupter
from xengine.colocation.resume import PausedStep, StepResumer
from xengine.scheduler.plan import SchedulePlan, StepOutput
from xengine.scheduler.scheduler import Scheduler
from xengine.step.execute import StepExecutor
from xengine.step.housekeeping import BetweenSteps
from xengine.step.result import StepResult

logger = logging.getLogger(__name__)


class NormalLoop:
    busy = False  # nothing runs between two calls

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        between: BetweenSteps,
        interrupter: Interrupter,
        resumer: StepResumer,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.between = between
        self.interrupter = interrupter
        self.resumer = resumer

    def step(self) -> StepResult:
        """One step: a paused step carried on, or a new plan scheduled; run; applied."""
        t0 = time.perf_counter()
        paused = self.resumer.ready(self.interrupter.pending_online)
        plan = paused.plan if paused is not None else self.scheduler.schedule()
        scheduled = time.perf_counter()
        self.between.after_schedule(plan, pool_was_free=self.between.pool_free())
        if plan.is_empty:
            return StepResult(plan)
        self.interrupter.started(plan)
        try:
            plan, out = self.executor.execute(plan) if paused is None else self._carry_on(paused)
        except StepInterrupted as stop:  # nothing of it applied: paused, or run again later
            self.interrupter.interrupted(plan, resumable=self.resumer.pause(plan, stop))
            return StepResult(SchedulePlan())
        counts = plan.token_counts()  # before update moves num_computed_tokens
        executed = time.perf_counter()
        self.scheduler.update(plan, out)
        phases = {
            "schedule": scheduled - t0,
            "prepare": out.prepare_s,
            "update": time.perf_counter() - executed,
        }
        return StepResult(plan, True, out.forward_s, counts, sample_s=out.sample_s, phases=phases)

    def _carry_on(self, paused: PausedStep) -> tuple[SchedulePlan, StepOutput]:
        """A paused step from where it stopped; if that fails, the step again from its start."""
        try:
            out = self.executor.resume(paused)
        except StepInterrupted:
            raise
        except Exception:  # noqa: BLE001 - the plain path isolates what is wrong with it
            logger.exception("resuming an interrupted step failed; running it again from its start")
            self.resumer.drop()
            return self.executor.execute(paused.plan)
        self.resumer.resumed()
        return paused.plan, out
