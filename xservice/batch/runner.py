"""The job runner: moves batches through their states and runs their lines as offline requests.

One background task that never stops. It takes the active batches oldest first (cancellations
before anything else) and, for the current one, keeps up to ``max_concurrent_lines`` lines in
flight. Everything it decides is read back from the store, so after a restart it simply continues:
``validating`` starts over, ``in_progress`` runs the lines not yet done, ``finalizing`` /
``cancelling`` write the files.

Hardening: a line that keeps killing the service or its engine is quarantined and a line past
``line_timeout_s`` is stopped (``quarantine.py``); a store that fails is retried with backoff for
``store_retry_s``, then the batch is failed if the store takes that write, and the loop goes on
(``runner_health.py``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, TypeVar

from xservice.batch.lines import (
    InputFileError,
    RetryLater,
    error_record,
    is_error_record,
    parse_lines,
    run_line,
)
from xservice.batch.quarantine import pick_lines, quarantine_record
from xservice.batch.runner_health import RunnerHealth, retry_store
from xservice.batch.store import BatchStore, PendingLine, StoreError, now
from xservice.config import BatchConfig
from xservice.serving.context import ServingContext

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Store calls that only read: their success says nothing about whether writes work again.
_READS = frozenset({"get_batch", "active_batch_ids", "pending_lines", "batch_ids_with_status"})
INGEST_CHUNK_LINES = 1000
RETRY_DELAY_S = 1.0
EXPIRY_CHECK_S = 5.0


class BatchRunner:
    """Drives every batch in ``store`` to a final state, serving lines through ``ctx``."""

    def __init__(
        self,
        ctx: ServingContext,
        store: BatchStore,
        max_concurrent_lines: int,
        config: BatchConfig | None = None,
        health: RunnerHealth | None = None,
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.max_concurrent_lines = max_concurrent_lines
        self.config = config or BatchConfig()
        self.health = health or RunnerHealth()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        """Stop at once; lines in flight stay pending and run again after the next start."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def wake(self) -> None:
        """Look at the store again (a batch was created or cancelled)."""
        self._wake.set()

    async def _store(self, fn: Any, *args: Any, in_thread: bool = False) -> Any:
        """A store call, retried with backoff while the store fails (``StoreError`` after the bound)."""
        writes = getattr(getattr(fn, "func", fn), "__name__", "") not in _READS
        retry_s = self.config.store_retry_s
        return await retry_store(self.health, retry_s, fn, *args, in_thread=in_thread, writes=writes)

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                batch_ids = await self._store(self.store.active_batch_ids)
            except StoreError:
                await asyncio.sleep(self.health.backoff_s())
                continue
            if not batch_ids:
                await self._wake.wait()
                continue
            await self._advance_safely(batch_ids[0])

    async def _advance_safely(self, batch_id: str) -> None:
        """One step of one batch; no error ends the loop."""
        try:
            await self._advance(batch_id)
        except asyncio.CancelledError:
            raise
        except StoreError as exc:  # failed for store_retry_s: stop this batch if the store lets us
            message = (
                f"The batch job store failed for {self.config.store_retry_s:.0f} s ({exc.message}); "
                "the batch was stopped."
            )
            await self._fail(batch_id, "batch_store_unavailable", message)
        except Exception:  # a bug must not stop every later batch: fail this one
            logger.exception("batch %s failed", batch_id)
            await self._fail(batch_id, "internal_error", "The batch runner failed.")

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        """Fail the batch visibly; if the store refuses even that, wait a backoff and let the loop retry."""
        try:
            self.store.fail_batch(batch_id, code, message)
        except StoreError as exc:  # still broken: the batch stays active and is taken up again
            self.health.store_failed(exc)
            await asyncio.sleep(self.health.backoff_s())
            return
        logger.error("batch %s failed: %s", batch_id, message)
        self.health.store_recovered()

    async def _advance(self, batch_id: str) -> None:
        batch = await self._store(self.store.get_batch, batch_id) or {}
        status = batch.get("status")
        if status == "validating":
            await self._validate(batch_id, batch["input_file_id"], batch["endpoint"])
        elif status == "in_progress":
            await self._run_lines(batch_id, batch["endpoint"], batch["expires_at"])
        elif status in ("finalizing", "cancelling"):
            final = "completed" if status == "finalizing" else "cancelled"
            await self._store(self.store.finalize, batch_id, final, in_thread=True)

    async def _validate(self, batch_id: str, input_file_id: str, endpoint: str) -> None:
        path = self.store.file_path(input_file_id)
        try:
            num_lines = await self._store(self._ingest, batch_id, path, endpoint, in_thread=True)
        except OSError as e:
            message = f"Cannot read input file {input_file_id}: {e}"
            await self._store(self.store.fail_batch, batch_id, "invalid_file", message)
            return
        except InputFileError as e:
            await self._store(self.store.reset_lines, batch_id)  # a failed batch ran no request
            await self._store(self.store.fail_batch, batch_id, "", "", e.errors)
            return
        if num_lines == 0:
            message = f"Input file {input_file_id} has no lines."
            await self._store(self.store.fail_batch, batch_id, "empty_file", message)
            return
        await self._store(self._set_status, batch_id, "in_progress", ("validating",))

    def _set_status(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> bool:
        return self.store.set_status(batch_id, status, only_from=only_from)

    def _ingest(self, batch_id: str, path: Path, endpoint: str) -> int:
        """Copy the input file's lines into the store, from scratch (so a retry starts clean)."""
        self.store.reset_lines(batch_id)
        num_lines = 0
        chunk = []
        with open(path, "rb") as f:
            for line in parse_lines(f, endpoint):
                chunk.append(line)
                if len(chunk) >= INGEST_CHUNK_LINES:
                    self.store.add_lines(batch_id, chunk)
                    num_lines += len(chunk)
                    chunk = []
        if chunk:
            self.store.add_lines(batch_id, chunk)
        return num_lines + len(chunk)

    # ------------------------------------------------------------------ lines

    async def _run_lines(self, batch_id: str, endpoint: str, expires_at: int | None) -> None:
        inflight: dict[asyncio.Task[dict], PendingLine] = {}
        queue: list[PendingLine] = []  # taken from the store (or sent back for a retry), not started
        cursor = -1  # highest line_no taken from the store
        try:
            while True:
                await self._finish_other_cancels(batch_id)
                status = ((await self._store(self.store.get_batch, batch_id)) or {}).get("status")
                if status != "in_progress":
                    return  # cancelled (or failed): the caller's next pass finalizes it
                if expires_at is not None and now() >= expires_at:
                    await self._expire(batch_id)
                    return
                if len(queue) < self.max_concurrent_lines:
                    room = self.max_concurrent_lines - len(queue)
                    fresh = await self._store(self.store.pending_lines, batch_id, cursor, room)
                    cursor = fresh[-1].line_no if fresh else cursor
                    queue += fresh
                queue = await self._start_lines(batch_id, endpoint, queue, inflight)
                if not inflight and not queue:
                    if await self._store(self.store.pending_lines, batch_id, cursor, 1):
                        continue  # quarantines emptied a full queue: take the next lines
                    await self._store(self._set_status, batch_id, "finalizing", ("in_progress",))
                    return
                queue = await self._collect(batch_id, inflight) + queue
        finally:
            await self._stop_inflight(batch_id, inflight)

    async def _start_lines(
        self,
        batch_id: str,
        endpoint: str,
        queue: list[PendingLine],
        inflight: dict[asyncio.Task[dict], PendingLine],
    ) -> list[PendingLine]:
        """Quarantine poison lines, start what may run now; returns the lines left waiting."""
        max_attempts = self.config.max_line_attempts
        pick = pick_lines(queue, list(inflight.values()), self.max_concurrent_lines, max_attempts)
        for line in pick.quarantine:
            record = quarantine_record(line, max_attempts)
            await self._store(self.store.finish_line, batch_id, line.line_no, record, True)
            self.health.num_quarantined += 1
            logger.error(
                "batch %s line %r quarantined: %s", batch_id, line.custom_id, record["error"]["message"]
            )
        for line in pick.start:
            await self._store(self.store.start_line, batch_id, line.line_no)
            inflight[asyncio.ensure_future(self._run_line(endpoint, line))] = line
        return pick.wait

    async def _run_line(self, endpoint: str, line: PendingLine) -> dict[str, Any]:
        """``run_line`` within the line's wall-clock budget (past it: aborted, a ``line_timeout`` record)."""
        timeout_s = self.config.line_timeout_s
        try:
            return await asyncio.wait_for(run_line(self.ctx, endpoint, line.custom_id, line.body), timeout_s)
        except TimeoutError:
            self.health.num_timed_out += 1
            message = f"The line ran longer than batch.line_timeout_s ({timeout_s:g} s) and was stopped."
            return error_record(line.custom_id, "line_timeout", message)

    async def _finish_other_cancels(self, batch_id: str) -> None:
        """A batch cancelled while another one runs has nothing in flight: finish it right away."""
        for other in await self._store(self.store.batch_ids_with_status, "cancelling"):
            if other != batch_id:
                await self._store(self.store.finalize, other, "cancelled", in_thread=True)

    async def _collect(
        self, batch_id: str, inflight: dict[asyncio.Task[dict], PendingLine]
    ) -> list[PendingLine]:
        """Wait for a line to finish (or a wake-up) and record what finished; returns lines to retry."""
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait(
                [*inflight, waker], timeout=EXPIRY_CHECK_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waker.cancel()
        self._wake.clear()
        retry: list[PendingLine] = []
        for task in done:
            line = inflight.pop(task, None)  # type: ignore[arg-type]
            if line is not None and not await self._record(batch_id, line, task):
                retry.append(line)
        if retry:
            await asyncio.sleep(RETRY_DELAY_S)
        return sorted(retry, key=lambda ln: ln.line_no)

    async def _record(self, batch_id: str, line: PendingLine, task: asyncio.Task[dict]) -> bool:
        """Store a finished line's record; False when it has to run again later."""
        try:
            record = task.result()
        except RetryLater as exc:
            logger.info("batch %s line %r: %s; will retry", batch_id, line.custom_id, exc)
            if exc.engine_stopped:
                line.attempts += 1  # the engine died under it: the attempt stays counted
            else:
                await self._store(self.store.take_back_line, batch_id, line.line_no)
            return False
        await self._store(self.store.finish_line, batch_id, line.line_no, record, is_error_record(record))
        return True

    async def _stop_inflight(self, batch_id: str, inflight: dict[asyncio.Task[dict], PendingLine]) -> None:
        """Keep lines that already finished; cancel the rest (aborting their engine requests).

        Cancelled lines stay pending, their attempt taken back: a cancelled batch leaves them out, a
        stopped service reruns them. Store errors here are logged, not retried (this runs on the way out).
        """
        sent_back: list[PendingLine] = []  # finished with RetryLater: no result, the attempt not counted
        for task, line in list(inflight.items()):
            if not task.done() or task.cancelled():
                continue
            del inflight[task]
            exc = task.exception()
            if exc is None:
                record = task.result()
                self._on_the_way_out(
                    self.store.finish_line, batch_id, line.line_no, record, is_error_record(record)
                )
            elif not (isinstance(exc, RetryLater) and exc.engine_stopped):  # (else it stays counted)
                sent_back.append(line)
        for task in inflight:
            task.cancel()
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
        for line in [*inflight.values(), *sent_back]:
            self._on_the_way_out(self.store.take_back_line, batch_id, line.line_no)
        inflight.clear()

    def _on_the_way_out(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except StoreError as exc:
            self.health.store_failed(exc)
            logger.warning("batch store call %s%r not done: %s", fn.__name__, args[:2], exc)

    async def _expire(self, batch_id: str) -> None:
        """Past the completion window: unfinished lines go to the error file as ``batch_expired``."""
        while lines := await self._store(self.store.pending_lines, batch_id, -1, INGEST_CHUNK_LINES):
            for line in lines:
                record = error_record(
                    line.custom_id, "batch_expired", "The batch expired before this line ran."
                )
                await self._store(self.store.finish_line, batch_id, line.line_no, record, True)
        await self._store(self.store.finalize, batch_id, "expired", in_thread=True)
