"""The batch subsystem of one app: its store and runner, opened lazily, resumed at startup.

Nothing is created on disk until the first Files/Batches call; if ``data_dir`` already holds a
store at startup, it is opened and its unfinished batches resume.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from xservice.batch.runner import BatchRunner
from xservice.batch.store import BatchStore
from xservice.config import BatchConfig
from xservice.errors import NotFoundError
from xservice.serving.context import ServingContext


class BatchService:
    def __init__(self, ctx: ServingContext, config: BatchConfig) -> None:
        self.ctx = ctx
        self.config = config
        self._store: BatchStore | None = None
        self._runner: BatchRunner | None = None

    @property
    def store(self) -> BatchStore:
        """The store, opened (and the runner started) on first use."""
        if self._store is None:
            self._store = BatchStore(self.config.resolved_data_dir)
            self._runner = BatchRunner(self.ctx, self._store, self.max_concurrent_lines)
            self._runner.start()
        return self._store

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
            _ = self.store

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
