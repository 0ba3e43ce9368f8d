"""How the batch runner is doing: store failures (retried with backoff), quarantined and timed-out lines.

``/metrics`` exports it (``xllm_batch_runner_healthy``, ``xllm_batch_runner_errors_total``,
``xllm_batch_lines_quarantined_total``, ``xllm_batch_lines_timed_out_total``) and ``/health`` adds
``batch_runner`` to its body while the runner is degraded (``docs/operations.md``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from xservice.batch.store import StoreError

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIN_BACKOFF_S = 0.25
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class BatchRunnerState:
    """A snapshot for ``/health`` and ``/metrics``; ``healthy`` is False while the store keeps failing."""

    healthy: bool = True
    num_store_errors: int = 0
    num_quarantined: int = 0
    num_timed_out: int = 0
    last_error: str | None = None
    degraded_since: float | None = None  # unix time of the first failure of the current outage


class RunnerHealth:
    """The runner's counters and its degraded / healthy state (changed only from the event loop)."""

    def __init__(self) -> None:
        self.num_store_errors = 0
        self.num_quarantined = 0
        self.num_timed_out = 0
        self.last_error: str | None = None
        self.degraded_since: float | None = None
        self._num_consecutive = 0

    def store_failed(self, exc: BaseException) -> None:
        self.num_store_errors += 1
        self._num_consecutive += 1
        self.last_error = str(exc)
        if self.degraded_since is None:
            self.degraded_since = time.time()
            logger.error("batch runner: the job store failed (%s); retrying with backoff", exc)

    def store_recovered(self) -> None:
        """A store write went through after failures (or a batch pass ended cleanly)."""
        if self.degraded_since is not None:
            logger.warning("batch runner: the job store works again")
        self.degraded_since = None
        self._num_consecutive = 0

    def backoff_s(self) -> float:
        """The next retry delay: doubling with each consecutive failure, capped."""
        return min(MAX_BACKOFF_S, MIN_BACKOFF_S * 2 ** max(0, self._num_consecutive - 1))

    def state(self) -> BatchRunnerState:
        return BatchRunnerState(
            healthy=self.degraded_since is None,
            num_store_errors=self.num_store_errors,
            num_quarantined=self.num_quarantined,
            num_timed_out=self.num_timed_out,
            last_error=self.last_error,
            degraded_since=self.degraded_since,
        )


async def retry_store(
    health: RunnerHealth,
    retry_s: float,
    fn: Callable[..., T],
    *args: Any,
    in_thread: bool = False,
    writes: bool = True,
) -> T:
    """``fn(*args)``, a store call (in a worker thread with ``in_thread``), retried with backoff while
    it raises ``StoreError``; gives up (re-raises) once it has failed for ``retry_s``, and the caller
    then fails the batch. A call that ``writes`` and goes through ends an outage (a read may work
    while writes still fail)."""
    first_failure: float | None = None
    while True:
        try:
            result = await asyncio.to_thread(fn, *args) if in_thread else fn(*args)
        except StoreError as exc:
            health.store_failed(exc)
            first_failure = first_failure or time.monotonic()
            if time.monotonic() - first_failure >= retry_s:
                raise
            await asyncio.sleep(health.backoff_s())
            continue
        if writes or first_failure is not None:
            health.store_recovered()
        return result
