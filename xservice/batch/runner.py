"""The job runner: moves batches through their states and runs their lines as offline requests.

One background task. It takes the active batches oldest first (cancellations before anything
else) and, for the current one, keeps up to ``max_concurrent_lines`` lines in flight. Everything
it decides is read back from the store, so after a restart it simply continues: ``validating``
starts over, ``in_progress`` runs the lines not yet done, ``finalizing`` / ``cancelling`` write
the files.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from xservice.batch.lines import (
    InputFileError,
    RetryLater,
    error_record,
    is_error_record,
    parse_lines,
    run_line,
)
from xservice.batch.store import BatchStore, PendingLine, now
from xservice.serving.context import ServingContext

logger = logging.getLogger(__name__)

INGEST_CHUNK_LINES = 1000
RETRY_DELAY_S = 1.0
EXPIRY_CHECK_S = 5.0


class BatchRunner:
    """Drives every batch in ``store`` to a final state, serving lines through ``ctx``."""

    def __init__(self, ctx: ServingContext, store: BatchStore, max_concurrent_lines: int) -> None:
        self.ctx = ctx
        self.store = store
        self.max_concurrent_lines = max_concurrent_lines
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

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            batch_ids = self.store.active_batch_ids()
            if not batch_ids:
                await self._wake.wait()
                continue
            try:
                await self._advance(batch_ids[0])
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop every later batch: fail this one
                logger.exception("batch %s failed", batch_ids[0])
                self.store.fail_batch(batch_ids[0], "internal_error", "The batch runner failed.")

    async def _advance(self, batch_id: str) -> None:
        batch = self.store.get_batch(batch_id) or {}
        status = batch.get("status")
        if status == "validating":
            await self._validate(batch_id, batch["input_file_id"], batch["endpoint"])
        elif status == "in_progress":
            await self._run_lines(batch_id, batch["endpoint"], batch["expires_at"])
        elif status == "finalizing":
            await asyncio.to_thread(self.store.finalize, batch_id, "completed")
        elif status == "cancelling":
            await asyncio.to_thread(self.store.finalize, batch_id, "cancelled")

    async def _validate(self, batch_id: str, input_file_id: str, endpoint: str) -> None:
        path = self.store.file_path(input_file_id)
        self.store.reset_lines(batch_id)
        try:
            num_lines = await asyncio.to_thread(self._ingest, batch_id, path, endpoint)
        except OSError as e:
            self.store.fail_batch(batch_id, "invalid_file", f"Cannot read input file {input_file_id}: {e}")
            return
        except InputFileError as e:
            self.store.reset_lines(batch_id)  # a failed batch ran no request
            self.store.fail_batch(batch_id, errors=e.errors)
            return
        if num_lines == 0:
            self.store.fail_batch(batch_id, "empty_file", f"Input file {input_file_id} has no lines.")
            return
        self.store.set_status(batch_id, "in_progress", only_from=("validating",))

    def _ingest(self, batch_id: str, path: Path, endpoint: str) -> int:
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
        retry: list[PendingLine] = []
        cursor = -1  # highest line_no taken from the store
        try:
            while True:
                await self._finish_other_cancels(batch_id)
                status = (self.store.get_batch(batch_id) or {}).get("status")
                if status != "in_progress":
                    return  # cancelled (or failed): the caller's next pass finalizes it
                if expires_at is not None and now() >= expires_at:
                    self._expire(batch_id)
                    return
                room = self.max_concurrent_lines - len(inflight)
                todo, retry = retry[:room], retry[room:]
                if len(todo) < room:
                    fresh = self.store.pending_lines(batch_id, cursor, room - len(todo))
                    cursor = fresh[-1].line_no if fresh else cursor
                    todo += fresh
                for line in todo:
                    self.store.start_line(batch_id, line.line_no)
                    task = asyncio.ensure_future(run_line(self.ctx, endpoint, line.custom_id, line.body))
                    inflight[task] = line
                if not inflight and not retry:
                    self.store.set_status(batch_id, "finalizing", only_from=("in_progress",))
                    return
                retry += await self._collect(batch_id, inflight)
        finally:
            await self._stop_inflight(batch_id, inflight)

    async def _finish_other_cancels(self, batch_id: str) -> None:
        """A batch cancelled while another one runs has nothing in flight: finish it right away."""
        for other in self.store.batch_ids_with_status("cancelling"):
            if other != batch_id:
                await asyncio.to_thread(self.store.finalize, other, "cancelled")

    async def _collect(self, batch_id: str, inflight: dict[asyncio.Task[dict], PendingLine]) -> list:
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
            if line is None:
                continue
            if not self._record(batch_id, line, task):
                retry.append(line)
        if retry:
            await asyncio.sleep(RETRY_DELAY_S)
        return retry

    def _record(self, batch_id: str, line: PendingLine, task: asyncio.Task[dict]) -> bool:
        """Store a finished line's record; False when it has to run again later."""
        try:
            record = task.result()
        except RetryLater as exc:
            logger.info("batch %s line %r: %s; will retry", batch_id, line.custom_id, exc)
            return False
        self.store.finish_line(batch_id, line.line_no, record, is_error_record(record))
        return True

    async def _stop_inflight(self, batch_id: str, inflight: dict[asyncio.Task[dict], PendingLine]) -> None:
        """Keep lines that already finished; cancel the rest (aborting their engine requests).

        Cancelled lines stay pending: a cancelled batch leaves them out, a stopped service reruns them.
        """
        for task, line in list(inflight.items()):
            if task.done() and not task.cancelled() and task.exception() is None:
                self._record(batch_id, line, task)
                del inflight[task]
        for task in inflight:
            task.cancel()
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
        inflight.clear()

    def _expire(self, batch_id: str) -> None:
        """Past the completion window: unfinished lines go to the error file as ``batch_expired``."""
        while lines := self.store.pending_lines(batch_id, -1, INGEST_CHUNK_LINES):
            for line in lines:
                record = error_record(
                    line.custom_id, "batch_expired", "The batch expired before this line ran."
                )
                self.store.finish_line(batch_id, line.line_no, record, is_error=True)
        self.store.finalize(batch_id, "expired")
