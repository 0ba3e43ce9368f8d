"""The batch runner survives job-store failures: real write errors, then the store comes back.

The failure is provoked for real: ``RLIMIT_FSIZE`` of the service process is dropped to one byte
(``prlimit``, as root or the same user), so every write to the store (SQLite's WAL, the files) fails
with ``EFBIG`` and SQLite reports ``disk I/O error``, exactly the error of a full or broken disk; reads
still work. Raising the limit again is the disk coming back.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.xservice.batch.helpers import (
    completion_line,
    openai_client,
    process_tree,
    read_file,
    start_batch_server,
    submit,
    wait_batch,
    wait_for,
)
from tests.xservice.batch.helpers import write_jsonl as write_lines

NUM_LINES = 24


def _store_holders(server: Any, db_path: Path) -> list[int]:
    """The processes of the service that have the job store open (the API server)."""
    holders = []
    for pid in process_tree(server.proc.pid):
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            targets = {os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)}
        except OSError:
            continue
        if str(db_path) in targets:
            holders.append(pid)
    assert holders, "no process has the job store open"
    return holders


@contextmanager
def _unwritable(server: Any, db_path: Path) -> Iterator[None]:
    """Every file write of the service fails (EFBIG) until the block ends."""
    pids = _store_holders(server, db_path)
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    for pid in pids:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
    try:
        yield
    finally:
        for pid in pids:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, unlimited)


def _metric(http: httpx.Client, name: str) -> float | None:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def _degraded(http: httpx.Client) -> dict[str, Any] | None:
    body = http.get("/health").json()
    return body.get("batch_runner") if _metric(http, "xllm_batch_runner_healthy") == 0.0 else None


def _lines(tag: str) -> list[dict[str, Any]]:
    return [
        completion_line(f"{tag}-{i}", f"Line {i} says", max_tokens=24, ignore_eos=True)
        for i in range(NUM_LINES)
    ]


@pytest.mark.parametrize("store_retry_s", [600.0, 1.0], ids=["short-outage", "past-the-bound"])
def test_runner_survives_store_write_errors(
    launch_server, model_dir: Path, tmp_path: Path, store_retry_s: float
) -> None:
    data_dir = tmp_path / "batch-data"
    settings = {"max_concurrent_lines": 2, "store_retry_s": store_retry_s}
    server = start_batch_server(launch_server, model_dir, data_dir, batch=settings)
    try:
        client = openai_client(server)
        first = _lines("a")
        batch_id = submit(client, write_lines(tmp_path / "a.jsonl", first), "/v1/completions").id
        with open(write_lines(tmp_path / "b.jsonl", _lines("b")), "rb") as f:
            second = client.files.create(file=f, purpose="batch")
        wait_for("lines done", lambda: client.batches.retrieve(batch_id).request_counts.completed >= 2)
        with server.client() as http, _unwritable(server, data_dir / "batch.db"):
            state = wait_for("runner degraded", lambda: _degraded(http))
            assert state["status"] == "degraded" and "disk I/O error" in state["last_error"], state
            assert _metric(http, "xllm_batch_runner_errors_total") >= 1
            # New work is refused with a 503 in OpenAI's shape, never a 500; reads still answer.
            resp = http.post("/v1/batches", json={"input_file_id": second.id, "endpoint": "/v1/completions"})
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "batch_store_unavailable"
            assert client.batches.retrieve(batch_id).status == "in_progress"
            if store_retry_s < 60:  # let the bound pass while the store is still broken
                wait_for(
                    "retries past the bound", lambda: _metric(http, "xllm_batch_runner_errors_total") >= 6
                )
        batch = wait_batch(client, batch_id)
        # Back: later batches run, and the runner says so.
        later = wait_batch(client, _create(client, second.id))
        assert later.status == "completed" and later.request_counts.completed == NUM_LINES, later
        with server.client() as http:
            assert _metric(http, "xllm_batch_runner_healthy") == 1.0
            assert "batch_runner" not in http.get("/health").json()
        output = read_file(client, batch.output_file_id)
    finally:
        server.stop()
    if batch.status == "failed":  # past the bound: failed visibly
        assert store_retry_s < 60, batch
        assert batch.errors.data[0].code == "batch_store_unavailable", batch
    else:  # the store came back within the bound: nothing lost, nothing twice
        assert batch.status == "completed", batch
        assert sorted(r["custom_id"] for r in output) == sorted(ln["custom_id"] for ln in first)


@contextmanager
def _immutable(folder: Path) -> Iterator[None]:
    """``chattr +i`` on ``folder``: no file can be created in it (root too) until the block ends."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr")
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i refused here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_batch_fails_visibly_when_its_output_cannot_be_written(
    launch_server, model_dir: Path, tmp_path: Path
) -> None:
    """SQLite works but no output file can be written: after ``store_retry_s`` the batch fails with
    ``batch_store_unavailable`` (not ``in_progress`` forever), and the next batch runs."""
    data_dir = tmp_path / "batch-data"
    server = start_batch_server(launch_server, model_dir, data_dir, batch={"store_retry_s": 1.0})
    try:
        client = openai_client(server)
        files = []
        for tag in ("a", "b"):
            with open(write_lines(tmp_path / f"{tag}.jsonl", _lines(tag)[:4]), "rb") as f:
                files.append(client.files.create(file=f, purpose="batch"))
        with _immutable(data_dir / "files"):
            batch = wait_batch(client, _create(client, files[0].id))
            with pytest.raises(openai.APIStatusError) as e, open(tmp_path / "a.jsonl", "rb") as f:
                client.files.create(file=f, purpose="batch")
            assert e.value.status_code == 503 and e.value.body["code"] == "batch_store_unavailable"
        later = wait_batch(client, _create(client, files[1].id))
        with server.client() as http:
            assert _metric(http, "xllm_batch_runner_healthy") == 1.0
            assert _metric(http, "xllm_batch_runner_errors_total") >= 2
    finally:
        server.stop()
    assert batch.status == "failed" and batch.failed_at is not None, batch
    [error] = batch.errors.data
    assert error.code == "batch_store_unavailable" and "cannot write a file" in error.message, error
    assert batch.output_file_id is None
    assert later.status == "completed" and later.request_counts.completed == 4, later


def _create(client: openai.OpenAI, file_id: str) -> str:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    ).id
