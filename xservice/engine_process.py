"""What the service needs to run engine child processes: their environment and a stderr tee."""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path
from typing import IO

STDERR_TAIL_LINES = 40


class StderrTee:
    """Copies the engine's stderr to ours, keeping the last lines for error messages."""

    def __init__(self, pipe: IO[bytes]):
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._thread = threading.Thread(target=self._pump, args=(pipe,), daemon=True, name="engine-stderr")
        self._thread.start()

    def _pump(self, pipe: IO[bytes]) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self._tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our stderr is closed; keep draining the pipe so the engine never blocks
        pipe.close()

    def tail(self, wait_s: float = 0.5) -> str:
        self._thread.join(wait_s)
        return "\n".join(self._tail)


def child_env() -> dict[str, str]:
    """Our environment, with this checkout first on PYTHONPATH so the engine runs the same code."""
    env = dict(os.environ)
    env.pop("XLLM_API_KEY", None)  # the service's secret; engines never need it
    root = str(Path(__file__).resolve().parents[1])  # the checkout holding xservice/ and xengine/
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in parts if p != root])
    return env
