"""The overlap loop (async scheduling): the model runs step ``i`` on a worker thread while the engine
thread schedules and prepares step ``i + 1``.

One ``step()`` of the engine thread: schedule step ``i`` (its requests advanced as if step ``i - 1``,
still running, had finished: ``xengine/scheduler/in_flight.py``), prepare its inputs (KV pages
mapped, placeholders for the tokens step ``i - 1`` is sampling), wait for step ``i - 1``, hand step
``i`` to the worker (which resolves the placeholders from step ``i - 1``'s sampled tokens before the
forward), then apply step ``i - 1``'s outputs (stop checks) while step ``i`` runs. Torch releases
the GIL in its kernels, so the host work of one step hides behind the forward of the next.

``sync`` plans (the forking step of ``n > 1`` requests, beam search steps) are applied as soon as they
ran: the next step depends on their outcome. A step that fails is undone and re-run synchronously
with the per-request fault isolation of ``execute.py``. Output is token-identical with the normal
loop (``docs/engine_performance.md``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from graph.interrupt import StepInterrupted
from xengine.colocation.interrupter import Interrupter
from xengine.runner.model_runner import ModelRunner
from xengine.scheduler.in_flight import rewind
from xengine.scheduler.plan import SchedulePlan, StepOutput, StepSample
from xengine.scheduler.scheduler import Scheduler
from xengine.step.execute import StepExecutor
from xengine.step.housekeeping import BetweenSteps
from xengine.step.result import StepResult

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    plan: SchedulePlan
    future: Future[StepOutput]
    counts: tuple[int, int]  # plan.token_counts(), taken at schedule time
    started_at: float  # perf_counter: the previous step's completion, or this step's schedule when idle


class OverlapLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        executor: StepExecutor,
        between: BetweenSteps,
        interrupter: Interrupter,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.executor = executor
        self.between = between
        self.interrupter = interrupter
        threads = torch.get_num_threads()
        # OpenMP thread counts are per calling thread: the worker sets its own
        self._executor = ThreadPoolExecutor(
            1, "xengine-step", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self._in_flight: _InFlight | None = None

    @property
    def busy(self) -> bool:
        """A step is on the worker: its outputs are still to be applied."""
        return self._in_flight is not None

    def step(self) -> StepResult:
        """One engine-thread call: schedule and prepare the next step, apply the one in flight, hand
        the next to the worker (a ``sync`` plan: and apply it too)."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        pool_was_free = self._in_flight is None and self.between.pool_free()
        result = self._advance(plan, t0)
        self.between.after_schedule(result.plan, pool_was_free)
        return result

    def _advance(self, plan: SchedulePlan, t0: float) -> StepResult:
        counts = plan.token_counts()
        prepared = self.runner.prepare(plan) if not plan.is_empty else None
        prev, self._in_flight = self._in_flight, None
        prev_out, completed, started_at, wait_s = None, [], t0, 0.0
        if prev is not None:
            t_wait = time.perf_counter()
            try:
                self.interrupter.wait(prev.future, prev.plan)  # an online arrival may stop it
                prev_out = prev.future.result()
            except StepInterrupted:  # undo both steps; the next schedule takes the online request
                rewind(plan)
                rewind(prev.plan)
                self.interrupter.interrupted(prev.plan)
                return self._result(SchedulePlan(), t0, time.perf_counter() - t_wait)
            except Exception:  # noqa: BLE001 - undo both steps, re-run the failed one with isolation
                wait_s = time.perf_counter() - t_wait
                return self._result(plan, t0, wait_s, self._recover(prev.plan, plan))
            started_at = time.perf_counter()
            wait_s = started_at - t_wait
            completed.append(StepSample(len(prev.plan.seqs), *prev.counts, started_at - prev.started_at))
        if prepared is not None:
            self.interrupter.arm()
            self.interrupter.started(plan)
            prev_rows = prev_out.sampled_rows if prev_out is not None else None
            future = self._executor.submit(self.runner.run, prepared, prev_rows)
            self._in_flight = _InFlight(plan, future, counts, started_at)
        forward_s = 0.0
        if prev is not None and prev_out is not None:
            self.scheduler.update(prev.plan, prev_out)
            forward_s = prev_out.forward_s
        if plan.sync and self._in_flight is not None:  # its outcome decides the next step
            t_wait = time.perf_counter()
            out = self._wait_current()
            t_done = time.perf_counter()
            wait_s += t_done - t_wait
            if out is not None:
                self.scheduler.update(plan, out)
                forward_s += out.forward_s
                completed.append(StepSample(len(plan.seqs), *counts, t_done - started_at))
        return self._result(plan, t0, wait_s, forward_s, completed, counts)

    @staticmethod
    def _result(
        plan: SchedulePlan,
        t0: float,
        wait_s: float,
        forward_s: float = 0.0,
        completed: list[StepSample] | None = None,
        counts: tuple[int, int] = (0, 0),
    ) -> StepResult:
        """``completed``: the steps whose outputs the engine thread applied in this call, each timed
        from the previous step's completion (the engine was busy) or from its own scheduling (idle)."""
        host_s = time.perf_counter() - t0 - wait_s  # engine-thread time, waiting excluded
        return StepResult(plan, not plan.is_empty, forward_s, counts, host_s, completed or [])

    def _wait_current(self) -> StepOutput | None:
        """The output of the step in flight; None when it was stopped or failed (undone, and a
        failed one run again with isolation)."""
        current, self._in_flight = self._in_flight, None
        assert current is not None
        try:
            self.interrupter.wait(current.future, current.plan)
            return current.future.result()
        except StepInterrupted:
            rewind(current.plan)
            self.interrupter.interrupted(current.plan)
            return None
        except Exception:  # noqa: BLE001
            self._recover(current.plan, SchedulePlan())
            return None

    def _recover(self, failed: SchedulePlan, scheduled: SchedulePlan) -> float:
        """Step ``failed`` raised on the worker: undo the advance of the plan scheduled on top of it
        (never run) and of ``failed``, then run ``failed`` again synchronously, one request at a time
        where needed (``StepExecutor.execute``). Returns its forward time."""
        logger.warning("an async step failed; re-running it synchronously")
        rewind(scheduled)
        rewind(failed)
        ran, out = self.executor.execute(failed, failed_once=True)
        self.scheduler.update(ran, out)
        return out.forward_s

    def close(self) -> None:
        """Stop the worker thread (after the step it runs)."""
        self._executor.shutdown(wait=True)
