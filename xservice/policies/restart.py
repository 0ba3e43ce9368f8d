"""When to restart a dead engine: exponential backoff, bounded restarts per window (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts allowed within ``window_s``; one more death then gives up
    window_s: float = 300.0
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, restart_times: Sequence[float], now: float) -> float | None:
        """Seconds to wait before the next restart, given when earlier restarts happened (same clock as
        ``now``); None once ``max_restarts`` restarts fell within the last ``window_s``: give up."""
        recent = sum(1 for t in restart_times if now - t < self.window_s)
        if recent >= self.max_restarts:
            return None
        return min(self.max_backoff_s, self.initial_backoff_s * 2**recent)
