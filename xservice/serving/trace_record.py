"""Recording a served trace (``service.record_trace``): one JSON line per finished request, what the cluster
simulator needs to replay the run (``python -m benchmarks.cluster_sim --replay FILE``) and what it is
checked against.

A line: ``{"arrival": wall-clock seconds the HTTP request came in, "prompt_tokens": ..., "output_tokens":
the longest of its sequences, "n": ..., "cached_tokens": ..., "ttft_s": ..., "tpot_s": ...}``. Only
requests that finished are recorded (a failed or cancelled one has no output length to replay).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceRecord:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    n: int = 1
    cached_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None


class TraceRecorder:
    """Appends ``TraceRecord`` lines to ``path`` (line-buffered, so a reader sees whole lines). A write that
    fails is logged once and recording stops; it never fails the request."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()
        self.num_recorded = 0

    def record(self, rec: TraceRecord) -> None:
        if self._file is None:
            return
        line = json.dumps({k: v for k, v in asdict(rec).items() if v is not None}, separators=(",", ":"))
        with self._lock:
            try:
                self._file.write(line + "\n")
                self.num_recorded += 1
            except OSError as e:
                logger.error("service.record_trace: writing %s failed (%s); recording stops", self.path, e)
                self._file = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def load_trace(path: str | Path) -> list[TraceRecord]:
    """The records of a recorded trace, by arrival (blank lines skipped; a bad line names its number)."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TraceRecord(**json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a trace record ({e})") from None
    return sorted(out, key=lambda r: r.arrival)
