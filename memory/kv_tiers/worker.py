"""One thread that runs every tier call, so disk reads, store RPCs and record copies stay off the
engine loop. Jobs go in with a tag; the engine collects ``(tag, result, error)`` when it polls."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class TierWorker:
    def __init__(self, name: str = "xllm-kv-tiers") -> None:
        self._jobs: queue.Queue[tuple[Any, Callable[[], Any]] | None] = queue.Queue()
        self._done: queue.Queue[tuple[Any, Any, BaseException | None]] = queue.Queue()
        self.num_pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tag: Any, job: Callable[[], Any]) -> None:
        self.num_pending += 1
        self._jobs.put((tag, job))

    def poll(self, timeout: float = 0.0) -> list[tuple[Any, Any, BaseException | None]]:
        """Finished jobs; waits up to ``timeout`` seconds for the first when none has finished."""
        out = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.num_pending -= len(out)
        return out

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            tag, job = item
            try:
                self._done.put((tag, job(), None))
            except Exception as e:  # noqa: BLE001 - reported to the engine, which carries on without
                logger.warning("KV tier job %r failed: %s", tag, e)
                self._done.put((tag, None, e))

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)
