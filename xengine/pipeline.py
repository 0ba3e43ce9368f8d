"""Async scheduling: the model runs step ``i`` on a worker thread while the engine thread works ahead.

One ``step()`` of the engine thread: schedule step ``i`` (its requests advanced as if step ``i - 1``,
still running, had finished: ``xengine/scheduler/in_flight.py``), prepare its inputs (KV pages
mapped, placeholders for the tokens step ``i - 1`` is sampling), wait for step ``i - 1``, hand step
``i`` to the worker (which resolves the placeholders from step ``i - 1``'s sampled tokens before the
forward), then apply step ``i - 1``'s outputs (stop checks, deltas) while step ``i`` runs. Torch
releases the GIL in its kernels, so the host work of one step hides behind the forward of the next.

``sync`` plans (the forking step of ``n > 1`` requests, beam search steps) are applied as soon as they
ran: the next step depends on their outcome. A step that fails is undone and re-run synchronously
with the engine's per-request fault isolation.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from graph.interrupt import StepInterrupted
from memory.kv_cache_manager import KVCacheManager
from xengine.api.messages import CompletionDelta
from xengine.interruption import Interrupter
from xengine.runner.model_runner import ModelRunner
from xengine.scheduler.in_flight import rewind
from xengine.scheduler.plan import SchedulePlan, StepOutput, StepSample
from xengine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    plan: SchedulePlan
    future: Future[StepOutput]
    counts: tuple[int, int]  # plan.token_counts(), taken at schedule time
    started_at: float  # perf_counter: the previous step's completion, or this step's schedule when idle


@dataclass
class PipelineTiming:
    host_s: float  # engine-thread time of the step() call, waiting excluded
    wait_s: float  # engine-thread time spent waiting for the worker
    forward_s: float  # the finished step's forward + logits time (on the worker)
    # the steps whose outputs the engine thread received in this call; ``step_s``: from the previous
    # step's completion (the engine was busy) or from this step's scheduling (it was idle) to its own
    completed: list[StepSample] = field(default_factory=list)
    counts: tuple[int, int] = (0, 0)  # token_counts() of the plan scheduled in this call


class PipelinedEngine(Protocol):
    """What the pipeline drives (``xengine/engine.py``'s ``Engine``)."""

    scheduler: Scheduler
    runner: ModelRunner
    kv: KVCacheManager
    interrupter: Interrupter

    def _collect_deltas(self) -> list[CompletionDelta]: ...

    def _execute(self, plan: SchedulePlan, failed_once: bool = False) -> tuple[SchedulePlan, StepOutput]: ...


class StepPipeline:
    def __init__(self, engine: PipelinedEngine) -> None:
        self.engine = engine
        threads = torch.get_num_threads()
        # OpenMP thread counts are per calling thread: the worker sets its own
        self._executor = ThreadPoolExecutor(
            1, "xengine-step", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self._in_flight: _InFlight | None = None
        self.last_timing = PipelineTiming(0.0, 0.0, 0.0)
        self.head_stuck = False

    @property
    def busy(self) -> bool:
        return self._in_flight is not None

    def step(self) -> tuple[SchedulePlan, list[CompletionDelta]]:
        """One engine-thread step; returns the plan scheduled now and the deltas of the step applied."""
        e = self.engine
        t0 = time.perf_counter()
        wait_s = 0.0
        plan = e.scheduler.schedule()
        counts = plan.token_counts()
        completed: list[StepSample] = []
        # nothing fits although nothing runs and the whole pool is free: the head can never run
        self.head_stuck = (
            plan.is_empty
            and self._in_flight is None
            and bool(e.scheduler.waiting)
            and e.kv.num_free_blocks == e.kv.pool.num_blocks
        )
        prepared = e.runner.prepare(plan) if not plan.is_empty else None
        prev, self._in_flight = self._in_flight, None
        prev_out = None
        started_at = t0
        if prev is not None:
            t_wait = time.perf_counter()
            try:
                e.interrupter.wait(prev.future, prev.plan)  # an online arrival may stop it
                prev_out = prev.future.result()
            except StepInterrupted:  # undo both steps; the next schedule takes the online request
                rewind(plan)
                rewind(prev.plan)
                e.interrupter.interrupted(prev.plan)
                wait_s += time.perf_counter() - t_wait
                self.last_timing = PipelineTiming(time.perf_counter() - t0 - wait_s, wait_s, 0.0)
                return SchedulePlan(), e._collect_deltas()
            except Exception:  # noqa: BLE001 - undo both steps, re-run the failed one with isolation
                wait_s += time.perf_counter() - t_wait
                self._recover(prev.plan, plan, t0, wait_s)
                return plan, e._collect_deltas()
            started_at = time.perf_counter()
            wait_s += started_at - t_wait
            completed.append(StepSample(len(prev.plan.seqs), *prev.counts, started_at - prev.started_at))
        if prepared is not None:
            prev_rows = prev_out.sampled_rows if prev_out is not None else None
            e.interrupter.arm()
            e.interrupter.started(plan)
            future = self._executor.submit(e.runner.run, prepared, prev_rows)
            self._in_flight = _InFlight(plan, future, counts, started_at)
        forward_s = 0.0
        if prev is not None and prev_out is not None:
            e.scheduler.update(prev.plan, prev_out)
            forward_s = prev_out.forward_s
        if plan.sync and self._in_flight is not None:  # its outcome decides the next step
            t_wait = time.perf_counter()
            out = self._wait_current()
            t_done = time.perf_counter()
            wait_s += t_done - t_wait
            if out is not None:
                e.scheduler.update(plan, out)
                forward_s += out.forward_s
                completed.append(StepSample(len(plan.seqs), *counts, t_done - started_at))
        host_s = time.perf_counter() - t0 - wait_s
        self.last_timing = PipelineTiming(host_s, wait_s, forward_s, completed, counts)
        return plan, e._collect_deltas()

    def _wait_current(self) -> StepOutput | None:
        current, self._in_flight = self._in_flight, None
        assert current is not None
        try:
            self.engine.interrupter.wait(current.future, current.plan)
            return current.future.result()
        except StepInterrupted:
            rewind(current.plan)
            self.engine.interrupter.interrupted(current.plan)
            return None
        except Exception:  # noqa: BLE001
            self._recover(current.plan, SchedulePlan(), 0.0, 0.0)
            return None

    def _recover(self, failed: SchedulePlan, scheduled: SchedulePlan, t0: float, wait_s: float) -> None:
        """Step ``failed`` raised on the worker: undo the advance of the plan scheduled on top of it
        (never run) and of ``failed``, then run ``failed`` again synchronously, one request at a time
        where needed (``Engine._execute``)."""
        e = self.engine
        logger.warning("an async step failed; re-running it synchronously")
        rewind(scheduled)
        rewind(failed)
        ran, out = e._execute(failed, failed_once=True)
        e.scheduler.update(ran, out)
        self.last_timing = PipelineTiming(time.perf_counter() - t0 - wait_s, wait_s, out.forward_s)

    def drain(self) -> list[CompletionDelta]:
        """Apply the step in flight (if any) without scheduling a new one."""
        if self._in_flight is None:
            return []
        current = self._in_flight
        out = self._wait_current()
        if out is not None:
            self.engine.scheduler.update(current.plan, out)
        return self.engine._collect_deltas()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
