"""``xllm serve``'s watchdog: a native crash of the API server (here a real SIGSEGV / SIGKILL of the
server process) is followed by a new server on the same port, with a new engine, and a batch that
was running resumes and completes; a clean stop is not restarted; the restart budget is bounded.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.xservice.batch.helpers import (
    completion_line,
    openai_client,
    read_file,
    submit,
    wait_batch,
    write_jsonl,
)
from tests.xservice.conftest import ServerHandle, start_server

WAIT_S = 180.0  # guards against a hang, not a timing assertion


def server_pid(watchdog: ServerHandle) -> int:
    """The API server: the watchdog's one child."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        pid = watchdog.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if len(children) == 1:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError("the watchdog has no server child")


def wait_serving(handle: ServerHandle, not_pid: int) -> int:
    """Wait until a server other than ``not_pid`` answers ready; its pid."""
    deadline = time.monotonic() + WAIT_S
    with httpx.Client(base_url=handle.base_url, timeout=WAIT_S) as http:
        while time.monotonic() < deadline:
            assert handle.proc.poll() is None, handle.log_tail()
            pid = server_pid(handle)
            if pid != not_pid and http.get("/health/ready").status_code == 200:
                return pid
            time.sleep(0.1)
    raise AssertionError(f"no new server after {WAIT_S}s:\n{handle.log_tail()}")


def test_a_crashed_server_is_restarted_and_its_batch_resumes(model_dir: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "batch-data"
    settings = {"batch": {"data_dir": str(data_dir), "max_concurrent_lines": 2}}
    service = {"engine_restart_backoff_s": 0.1}
    handle = start_server(model_dir, service, engine=settings)
    try:
        client = openai_client(handle)
        lines = [completion_line(f"l-{i}", f"Line {i}", max_tokens=40, ignore_eos=True) for i in range(12)]
        batch_id = submit(client, write_jsonl(tmp_path / "in.jsonl", lines), "/v1/completions").id
        wait_batch(client, batch_id, until=lambda b: b.request_counts.completed >= 2)
        first = server_pid(handle)
        with httpx.Client(base_url=handle.base_url) as http:
            engine = http.get("/v1/admin/stats").json()["engine_pid"]
        os.kill(first, signal.SIGSEGV)  # what the grammar payload did: a native fault of the server
        second = wait_serving(handle, not_pid=first)
        assert not Path(f"/proc/{engine}").exists() or _is_zombie(engine)  # the old engine went with it
        batch = wait_batch(openai_client(handle), batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == len(lines), batch
        assert sorted(r["custom_id"] for r in read_file(client, batch.output_file_id)) == sorted(
            line["custom_id"] for line in lines
        )
        assert "the API server was killed by SIGSEGV; restarting it" in handle.log_tail(100_000)
        os.kill(second, signal.SIGKILL)  # an OOM kill or kill -9: the same
        wait_serving(handle, not_pid=second)
    finally:
        handle.stop()
    assert handle.proc.returncode == 0  # SIGTERM to the watchdog: a graceful stop, not restarted


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_the_restart_budget_is_bounded(model_dir: Path) -> None:
    service = {"engine_max_restarts": 1, "engine_restart_backoff_s": 0.1}
    handle = start_server(model_dir, service)
    try:
        first = server_pid(handle)
        os.kill(first, signal.SIGKILL)
        second = wait_serving(handle, not_pid=first)
        os.kill(second, signal.SIGKILL)  # the second crash within the window: the budget is one
        assert handle.proc.wait(WAIT_S) == 1
        assert "crashed 2 times within 300s; giving up" in handle.log_tail(100_000)
    finally:
        handle.stop()


def test_no_watchdog_runs_the_server_directly(model_dir: Path) -> None:
    handle = start_server(model_dir, {"watchdog": False})
    try:
        with httpx.Client(base_url=handle.base_url) as http:
            engine = http.get("/v1/admin/stats").json()["engine_pid"]
        stat = Path(f"/proc/{engine}/stat").read_text()
        assert int(stat.rsplit(")", 1)[1].split()[1]) == handle.proc.pid  # the engine's parent is it
    finally:
        handle.stop()
