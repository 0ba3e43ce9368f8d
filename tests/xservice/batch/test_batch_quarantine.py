"""Poison-pill lines: a batch line under which the service (or its engine) keeps dying is quarantined.

The deaths are real: the whole service process tree is SIGKILLed (as a native crash would end it)
while that line is in flight, then a new service starts on the same data dir; or only the engine
is SIGKILLed and the supervisor restarts it. After ``batch.max_line_attempts`` such deaths the line
fails with ``line_quarantined`` in the error file, is never sent again, and the rest of the batch
completes. Plus the pure line policy (``xservice/batch/quarantine.py``).
"""

from __future__ import annotations

import functools
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

from tests.xservice.batch.helpers import (
    completion_line,
    kill_tree,
    openai_client,
    read_file,
    start_batch_server,
    submit,
    wait_batch,
    wait_for,
)
from tests.xservice.batch.helpers import write_jsonl as write_lines
from xservice.batch.quarantine import pick_lines
from xservice.batch.store import PendingLine
from xservice.config import BatchConfig

MAX_ATTEMPTS = BatchConfig().max_line_attempts  # the default, 3


def line_state(db_path: Path, batch_id: str, custom_id: str) -> tuple[int, bool]:
    """(attempts, done) of one line, read from the job store while the service runs."""
    with sqlite3.connect(db_path, timeout=10) as db:
        row = db.execute(
            "SELECT attempts, done FROM lines WHERE batch_id = ? AND custom_id = ?", (batch_id, custom_id)
        ).fetchone()
    return (row[0], bool(row[1])) if row else (0, False)


def _is_sent(db_path: Path, batch_id: str, custom_id: str, attempts: int) -> bool:
    """The line's ``attempts``-th send is committed and it has not finished."""
    return line_state(db_path, batch_id, custom_id) == (attempts, False)


# ---------------------------------------------------------------------- the policy


def _line(line_no: int, attempts: int = 0) -> PendingLine:
    return PendingLine(line_no, f"l{line_no}", {}, attempts)


def _nos(lines: list[PendingLine]) -> list[int]:
    return [ln.line_no for ln in lines]


def test_pick_quarantines_at_the_bound_and_runs_suspects_alone() -> None:
    queue = [_line(0), _line(1, attempts=3), _line(2), _line(3), _line(4)]
    pick = pick_lines(queue, running=[], room=3, max_attempts=3)
    assert (_nos(pick.start), _nos(pick.quarantine), _nos(pick.wait)) == ([0, 2, 3], [1], [4])
    # A suspect waits for the lines in flight to drain, and nothing overtakes it.
    pick = pick_lines([_line(5, attempts=1), _line(6)], running=[_line(0)], room=3, max_attempts=3)
    assert (_nos(pick.start), _nos(pick.wait)) == ([], [5, 6])
    # Then it runs alone; nothing starts beside it.
    pick = pick_lines([_line(5, attempts=2), _line(6)], running=[], room=3, max_attempts=3)
    assert (_nos(pick.start), _nos(pick.wait)) == ([5], [6])
    pick = pick_lines(
        [_line(6), _line(7, attempts=3)], running=[_line(5, attempts=2)], room=3, max_attempts=3
    )
    assert (_nos(pick.start), _nos(pick.quarantine), _nos(pick.wait)) == ([], [7], [6])


# ---------------------------------------------------------------------- real deaths


def _check_quarantined(client: Any, batch_id: str, lines: list[dict[str, Any]], poison: str) -> Any:
    batch = wait_batch(client, batch_id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), len(lines) - 1, 1)
    [record] = read_file(client, batch.error_file_id)
    assert record["custom_id"] == poison and record["response"] is None
    assert record["error"]["code"] == "line_quarantined"
    assert f"{MAX_ATTEMPTS} times" in record["error"]["message"]
    output = read_file(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(
        ln["custom_id"] for ln in lines if ln["custom_id"] != poison
    )
    return batch


def test_a_line_that_keeps_killing_the_service_is_quarantined(
    launch_server, model_dir: Path, tmp_path: Path
) -> None:
    data_dir = tmp_path / "batch-data"
    db_path = data_dir / "batch.db"
    settings = {"max_concurrent_lines": 2}
    lines = [completion_line(f"ok-{i}", f"Line {i} says", max_tokens=4) for i in range(5)]
    lines.insert(1, completion_line("poison", "Never ending", max_tokens=200, ignore_eos=True))
    path = write_lines(tmp_path / "in.jsonl", lines)

    server = start_batch_server(launch_server, model_dir, data_dir, batch=settings)
    try:
        batch_id = submit(openai_client(server), path, "/v1/completions").id
        for death in range(1, MAX_ATTEMPTS + 1):
            # committed before the line is sent; 200 tokens to go: it is in flight when the service dies
            wait_for(f"poison sent #{death}", functools.partial(_is_sent, db_path, batch_id, "poison", death))
            kill_tree(server)
            server.stop()
            server = start_batch_server(launch_server, model_dir, data_dir, batch=settings)
        _check_quarantined(openai_client(server), batch_id, lines, "poison")
        assert line_state(db_path, batch_id, "poison") == (MAX_ATTEMPTS, True)  # not sent again
        log = server.log_tail(20000)
    finally:
        server.stop()
    assert "quarantined" in log
    with sqlite3.connect(db_path) as db:  # innocent lines that ran beside it were cleared, not quarantined
        attempts = dict(db.execute("SELECT custom_id, attempts FROM lines WHERE batch_id = ?", (batch_id,)))
    assert all(1 <= n <= 2 for cid, n in attempts.items() if cid != "poison"), attempts


def test_a_line_that_keeps_killing_the_engine_is_quarantined(
    launch_server, model_dir: Path, tmp_path: Path
) -> None:
    """The service survives; the supervisor restarts the engine each time; the line is quarantined in place."""
    lines = [completion_line("poison", "Never ending", max_tokens=200, ignore_eos=True)]
    lines += [completion_line(f"ok-{i}", f"Line {i} says", max_tokens=4) for i in range(3)]
    path = write_lines(tmp_path / "in.jsonl", lines)
    server = start_batch_server(
        launch_server, model_dir, tmp_path / "batch-data", batch={"max_concurrent_lines": 1}
    )
    try:
        client = openai_client(server)
        batch_id = submit(client, path, "/v1/completions").id
        with server.client() as http:

            def running_pid() -> int | None:  # the engine's pid once the poison line runs in it
                resp = http.get("/v1/admin/stats")
                stats = resp.json() if resp.status_code == 200 else {}
                return stats["engine_pid"] if stats.get("num_running") == 1 else None

            for death in range(1, MAX_ATTEMPTS + 1):
                pid = wait_for(f"poison running #{death}", running_pid)
                os.kill(pid, signal.SIGKILL)
                wait_for("engine replaced", lambda: http.get("/health").status_code == 200)
            batch = _check_quarantined(client, batch_id, lines, "poison")
            metrics = http.get("/metrics").text
        assert batch.status == "completed"
        assert "xllm_batch_lines_quarantined_total 1.0" in metrics
        assert 'xllm_engine_restarts_total{instance="local"} 3.0' in metrics
    finally:
        server.stop()
