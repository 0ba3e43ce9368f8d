"""Online arrivals preempt offline prefill between layers: the engine side of watching for them.

A plan of only offline work that prefills is ``interruptible`` (``Scheduler.schedule``). Such a step
runs on a worker thread while the engine thread keeps reading the engine process's inputs (``watch``,
set by ``xengine/process/engine_proc.py``); an online ``AddRequest`` among them sets the step's
interrupt event, and the step stops at its next check (``layer_checks.py``, or the attention op of a
compiled graph). With ``offline_preemption: step`` the inputs are read the same way but the event is
never set: the online request waits for the step to end. In-process use (``LLM``) has no watcher.

Preemption latency is measured per online request that arrived while an offline prefill step ran:
from its arrival at the engine to the start of the step that begins its prefill. See
``docs/colocation.md``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from xengine.api.messages import ColocationStatsMsg
from xengine.request import Request
from xengine.scheduler.plan import SchedulePlan

WATCH_S = 0.05  # longest single wait of the engine thread for inputs while an interruptible step runs
MAX_LATENCIES = 256


class Interrupter:
    """Watches the engine's inputs while an interruptible step runs, stops it for online arrivals
    (``layer`` mode), and counts what was stopped and how long online requests waited."""

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "layer" | "step" (``scheduler.offline_preemption``)
        self.event = threading.Event()  # read by the forward's attention op (any thread)
        # set by the engine process: ``watch(timeout_s, wake_fd)`` reads inputs until ``wake_fd`` is
        # readable (the step ended) or the timeout; it calls ``online_arrived`` for online requests
        self.watch: Callable[[float, int], None] | None = None
        self.pending_online = 0  # online requests read by ``watch`` and not yet handed to the engine
        self.num_interrupted_steps = 0
        self.num_interrupted_tokens = 0  # tokens of interrupted steps, computed again later
        self.num_paused_steps = 0  # interrupted steps kept to carry on later (``resume.py``)
        self.latencies: deque[float] = deque(maxlen=MAX_LATENCIES)
        self.arrivals: dict[str, float] = {}  # online req id -> when ``watch`` read it
        self._executor: ThreadPoolExecutor | None = None
        self._wake: tuple[int, int] | None = None  # pipe: a byte is written when a watched step ends

    @property
    def watching(self) -> bool:
        return self.watch is not None

    def online_arrived(self, req_id: str) -> None:
        """An online request came in while an offline step runs (engine thread, from ``watch``):
        stop the step (``layer`` mode) and remember when it came, for its preemption latency."""
        self.pending_online += 1
        self.arrivals[req_id] = time.monotonic()
        if self.mode == "layer":
            self.event.set()

    def inputs_drained(self) -> None:
        """Every input read so far is now in the engine: nothing online is pending any more (an
        arrival still listed was refused before reaching the scheduler)."""
        self.pending_online = 0
        self.arrivals.clear()

    def arm(self) -> None:
        """A step starts: only online requests not yet in the engine may interrupt it."""
        self.event.clear()
        if self.pending_online and self.mode == "layer":
            self.event.set()

    def wait(self, future: Future, plan: SchedulePlan) -> None:
        """Until ``future`` is done, keep reading inputs when ``plan`` may be interrupted."""
        if not (plan.interruptible and self.watching):
            return
        assert self.watch is not None
        if self._wake is None:
            self._wake = os.pipe()
            os.set_blocking(self._wake[0], False)
        wake_r, wake_w = self._wake
        future.add_done_callback(lambda _: os.write(wake_w, b"x"))
        while not future.done():
            self.watch(WATCH_S, wake_r)
        with contextlib.suppress(BlockingIOError):
            while os.read(wake_r, 64):
                pass

    def run(self, plan: SchedulePlan, fn: Callable[[], object]) -> object:
        """``fn()`` for ``plan``: on a worker thread while the engine thread watches inputs when the
        plan may be interrupted, else right here. Raises what ``fn`` raises (``StepInterrupted``)."""
        if not (plan.interruptible and self.watching):
            return fn()
        if self._executor is None:
            threads = torch.get_num_threads()
            self._executor = ThreadPoolExecutor(
                1, "xengine-interruptible", initializer=torch.set_num_threads, initargs=(threads,)
            )
        self.arm()
        future = self._executor.submit(fn)
        self.wait(future, plan)
        return future.result()

    def interrupted(self, plan: SchedulePlan, resumable: bool = False) -> None:
        """``plan`` stopped: paused to carry on later (``resumable``), or to be computed again."""
        self.num_interrupted_steps += 1
        if resumable:
            self.num_paused_steps += 1
        else:
            self.num_interrupted_tokens += sum(s.num_new_tokens for s in plan.seqs)

    def started(self, plan: SchedulePlan) -> None:
        """``plan`` starts running: record the preemption latency of online prefills it begins."""
        now = time.monotonic()
        for s in plan.seqs:
            req = s.req
            if req.started_at is None:
                req.started_at = now
                if req.arrived_during_offline:
                    self.latencies.append(now - req.received_at)

    def stats(self) -> ColocationStatsMsg:
        lat = sorted(self.latencies)

        def pct(q: float) -> float:
            return round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else 0.0

        return ColocationStatsMsg(
            offline_preemption=self.mode,
            num_interrupted_steps=self.num_interrupted_steps,
            num_interrupted_tokens=self.num_interrupted_tokens,
            num_paused_steps=self.num_paused_steps,
            num_latencies=len(lat),
            preemption_latency_p50_ms=pct(0.5),
            preemption_latency_p99_ms=pct(0.99),
            preemption_latency_max_ms=round(1000 * lat[-1], 3) if lat else 0.0,
        )

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for fd in self._wake or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake = None


def note_arrival(req: Request, interrupter: Interrupter) -> None:
    """An online request read while an offline prefill step ran arrived when it was read; its
    preemption latency is recorded when its first step starts."""
    read_at = interrupter.arrivals.pop(req.req_id, None)
    if read_at is not None:
        req.received_at = read_at
        req.arrived_during_offline = True
