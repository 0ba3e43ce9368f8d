"""``PageMapper``: runs map calls on a background thread, so pre-mapping stays off the critical path.

The layout decides *what* to map synchronously (its bookkeeping is always current) and hands the
calls over as one batch per step: the pages this step reads are waited for before the forward; the
look-ahead pages the next step will need are mapped while this step's forward runs. ``wait`` blocks
until every batch handed over so far is done and re-raises the first failure.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

MapCall = Callable[[], None]


class PageMapper:
    def __init__(self) -> None:
        self._queue: queue.Queue[list[MapCall] | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name="xtensor-mapper")
        self._thread.start()

    def submit(self, calls: list[MapCall]) -> None:
        if not calls:
            return
        with self._done:
            self._pending += 1
        self._queue.put(calls)

    def wait(self) -> None:
        with self._done:
            while self._pending:
                self._done.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def stop(self) -> None:
        """Let the thread end once the batches handed over are done (safe from any thread)."""
        self._queue.put(None)

    def close(self) -> None:
        self.stop()
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            calls = self._queue.get()
            if calls is None:
                return
            t0 = time.perf_counter()
            call = None
            try:
                for call in calls:
                    call()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                with self._done:
                    self._error = self._error or e
            finally:
                with self._done:
                    self.seconds += time.perf_counter() - t0
                    self._pending -= 1
                    self._done.notify_all()
            calls = call = None  # they hold the layout (bound map calls): let it go while waiting
