"""The batch subsystem of one app: its store and runner, opened lazily, resumed at startup.

Nothing is created on disk until the first Files/Batches call; if ``data_dir`` already holds a
store at startup, it is opened and its unfinished batches resume.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from xservice.batch.quota import FileQuota
from xservice.batch.runner import BatchRunner
from xservice.batch.runner_health import BatchRunnerState, RunnerHealth
from xservice.batch.store import BatchStore, StoreError
from xservice.config import BatchConfig
from xservice.http.errors import NotFoundError
from xservice.serving.context import ServingContext

logger = logging.getLogger(__name__)


class BatchService:
    """The app's batch store and runner, and the runner's health (exported in ``/metrics``)."""

    def __init__(self, ctx: ServingContext, config: BatchConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.health = RunnerHealth()
        self._store: BatchStore | None = None
        self._runner: BatchRunner | None = None
        ctx.metrics.watch_batch_runner(self.health.state)

    @property
    def store(self) -> BatchStore:
        """The store, opened (and the runner started) on first use; ``StoreError`` (503) if it cannot be."""
        if self._store is None:
            try:
                self._store = BatchStore(self.config.resolved_data_dir)
            except StoreError as exc:
                self.health.store_failed(exc)
                raise
            self.health.store_recovered()
            self._runner = BatchRunner(
                self.ctx, self._store, self.max_concurrent_lines, self.config, self.health
            )
            self._runner.start()
        return self._store

    @property
    def quota(self) -> FileQuota:
        c = self.config
        return FileQuota(
            c.max_files, c.max_total_file_bytes, c.max_files_per_caller, c.max_file_bytes_per_caller
        )

    def runner_state(self) -> BatchRunnerState:
        """The runner's health (``healthy`` False while its store keeps failing)."""
        return self.health.state()

    @property
    def max_concurrent_lines(self) -> int:
        """Batch lines take admission slots like HTTP requests: leave at least half to online ones."""
        half = self.ctx.config.service.max_pending_requests // 2
        return max(1, min(self.config.max_concurrent_lines, half))

    def wake(self) -> None:
        if self._runner is not None:
            self._runner.wake()

    def resume(self) -> None:
        """Open an existing store so its unfinished batches continue."""
        if (self.config.resolved_data_dir / "batch.db").is_file():
            try:
                _ = self.store
            except StoreError as exc:  # the next Files/Batches call tries again
                logger.error("batch store not opened at start-up: %s", exc)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
        if self._store is not None:
            self._store.close()
        self._store = self._runner = None


@asynccontextmanager
async def batch_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """App lifespan: resume unfinished batches at startup, stop the runner at shutdown."""
    service: BatchService = app.state.batch
    service.resume()
    try:
        yield
    finally:
        await service.close()


def get_batch_service(request: Request) -> BatchService:
    """FastAPI dependency: the app's ``BatchService``."""
    return request.app.state.batch


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """An OpenAI list object (files, batches) with its paging cursors."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def found_or_404(obj: dict[str, Any] | None, kind: str, param: str, obj_id: str) -> dict[str, Any]:
    """``obj``, or the OpenAI-shaped 404 for an unknown file / batch id."""
    if obj is None:
        raise NotFoundError(f"No such {kind}: '{obj_id}'.", param=param)
    return obj
