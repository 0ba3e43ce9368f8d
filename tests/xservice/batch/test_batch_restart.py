"""Durability: stop the service mid-job (SIGKILL of it and its engine, or SIGTERM), start a new one
on the same data dir.

The job resumes by itself; every line is in the output exactly once; the lines finished before the
kill are not recomputed: their output records (ids, request ids, texts) are the ones committed
before the kill, and their ``attempts`` counter in the job store is still 1.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.xservice.batch.helpers import (
    completion_line,
    kill_tree,
    openai_client,
    read_file,
    start_batch_server,
    submit,
    wait_batch,
)
from tests.xservice.batch.helpers import write_jsonl as write_lines

NUM_LINES = 40


def _snapshot(db_path: Path, batch_id: str) -> dict[str, dict[str, Any]]:
    """``custom_id -> {done, result, attempts}`` straight from the job store."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute(
            "SELECT custom_id, done, result, attempts FROM lines WHERE batch_id = ?", (batch_id,)
        ).fetchall()
    return {
        cid: {"done": bool(done), "result": json.loads(result) if result else None, "attempts": attempts}
        for cid, done, result, attempts in rows
    }


def _stop(server: Any, sig: signal.Signals) -> None:
    """SIGKILL the service's whole process tree, engine included (nothing gets to clean up), or
    SIGTERM the service (graceful)."""
    if sig == signal.SIGKILL:
        kill_tree(server)
        return
    os.kill(server.proc.pid, sig)
    server.proc.wait(timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_restart_mid_job_resumes_without_loss_or_recompute(
    launch_server, model_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    data_dir = tmp_path / "batch-data"
    settings = {"max_concurrent_lines": 2}  # few lines at a time, so the kill lands mid-job
    lines = [
        completion_line(f"line-{i}", f"Line {i} says", max_tokens=30, ignore_eos=True)
        for i in range(NUM_LINES)
    ]
    path = write_lines(tmp_path / "in.jsonl", lines)

    first = start_batch_server(launch_server, model_dir, data_dir, batch=settings)
    try:
        client = openai_client(first)
        batch_id = submit(client, path, "/v1/completions").id
        wait_batch(client, batch_id, until=lambda b: b.request_counts.completed >= 6)
        _stop(first, sig)
    finally:
        first.stop()
    before = _snapshot(data_dir / "batch.db", batch_id)
    done_before = {cid: s["result"] for cid, s in before.items() if s["done"]}
    assert 6 <= len(done_before) < NUM_LINES, len(done_before)
    assert all(s["attempts"] == 1 for s in before.values() if s["done"])

    second = start_batch_server(launch_server, model_dir, data_dir, batch=settings)
    try:
        client = openai_client(second)
        batch = wait_batch(client, batch_id)  # resumed without being asked
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed) == (NUM_LINES, NUM_LINES)
        output = read_file(client, batch.output_file_id)
    finally:
        second.stop()

    assert batch.error_file_id is None
    assert sorted(r["custom_id"] for r in output) == sorted(ln["custom_id"] for ln in lines)
    assert len(output) == NUM_LINES  # each exactly once
    by_id = {r["custom_id"]: r for r in output}
    for cid, record in done_before.items():
        assert by_id[cid] == record  # the record from before the kill: not recomputed
    after = _snapshot(data_dir / "batch.db", batch_id)
    assert all(after[cid]["attempts"] == 1 for cid in done_before)
    # Lines in flight at the kill ran again (at most max_concurrent_lines of them); the rest once.
    rerun = [cid for cid, s in after.items() if s["attempts"] > 1]
    assert len(rerun) <= settings["max_concurrent_lines"] and not set(rerun) & set(done_before)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 30 for r in output)
