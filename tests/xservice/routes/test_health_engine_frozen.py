"""``/health`` follows the engine's readiness: a frozen engine (SIGSTOP of the real engine process)
turns it 503 ``engine_not_answering`` while liveness holds, and SIGCONT turns it back to 200."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

GUARD_S = 60.0  # guards against a hang, not a timing assertion


def _wait_status(http: httpx.Client, path: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        resp = http.get(path)
        if resp.status_code == status:
            return resp
        time.sleep(0.1)
    raise AssertionError(f"{path} not {status} after {GUARD_S}s: {resp.status_code} {resp.text}")


def test_health_follows_a_frozen_engine(launch_server, model_dir: Path) -> None:
    server = launch_server(model_dir, {})
    try:
        # The client's timeout is far below the engine's freeze: a probe that waited on it would fail.
        with httpx.Client(base_url=server.base_url, timeout=10.0) as http:
            assert http.get("/health").json() == {"status": "ok"}
            engine_pid = http.get("/v1/admin/stats").json()["engine_pid"]
            os.kill(engine_pid, signal.SIGSTOP)
            try:
                frozen = _wait_status(http, "/health", 503)
                assert frozen.json()["error"]["code"] == "engine_not_answering"
                assert frozen.json()["error"]["type"] == "service_unavailable"
                assert http.get("/health/live").status_code == 200  # not a reason to kill the pod
                for _ in range(20):  # it stays 503 while frozen: every probe answers (cached ping)
                    assert http.get("/health").status_code == 503
            finally:
                os.kill(engine_pid, signal.SIGCONT)
            _wait_status(http, "/health", 200)
            assert http.get("/v1/admin/stats").json()["engine_pid"] == engine_pid  # the same engine, resumed
    finally:
        server.stop()
