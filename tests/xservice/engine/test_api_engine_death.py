"""Kill (or freeze) the engine under a live ``xllm serve``: streams end with an error event, the service
answers 503 and fails ``/health`` while the supervisor restarts the engine, then serves again with the
same outputs; past its restart budget the supervisor gives up and liveness fails."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

GUARD_S = 120.0  # keeps a broken build from hanging the suite; not a timing assertion
SERVICE = {"engine_restart_backoff_s": 0.2, "engine_hang_timeout_s": 4.0}


@pytest.fixture(scope="module")
def doomed_server(model_dir, launch_server) -> Iterator[object]:
    handle = launch_server(model_dir, {**SERVICE, "engine_max_restarts": 2}, via_cli=True)
    yield handle
    handle.stop()


def _stream_until(http: httpx.Client, body: dict, after_events: int, fault) -> list[str]:
    events: list[str] = []
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == after_events:
                    fault()
    return events


def _wait_serving(http: httpx.Client, old_pid: int) -> int:
    deadline = time.monotonic() + GUARD_S
    while True:
        assert time.monotonic() < deadline, "the engine was not restarted"
        if http.get("/health").status_code == 200:
            pid = http.get("/v1/admin/stats").json()["engine_pid"]
            assert pid != old_pid
            return pid
        time.sleep(0.1)


def _restarts(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('xllm_engine_restarts_total{instance="local"}'):
            return float(line.split()[-1])
    raise AssertionError("no restart counter in /metrics")


def test_engine_killed_mid_stream_is_restarted(doomed_server) -> None:
    body = {"prompt": "A very long story:", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=doomed_server.base_url, timeout=GUARD_S) as http:
        expected = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        engine_pid = http.get("/v1/admin/stats").json()["engine_pid"]
        assert engine_pid != doomed_server.proc.pid
        events = _stream_until(
            http, {**body, "max_tokens": 230, "stream": True}, 2, lambda: os.kill(engine_pid, signal.SIGKILL)
        )
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and error["message"]

        # while it restarts: 503 with Retry-After; /health fails, /health/live does not
        health = http.get("/health")
        if health.status_code == 503:  # (the restart may already be done on a fast box)
            assert health.json()["error"]["code"] == "engine_restarting"
            assert http.get("/health/live").status_code == 200
            resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert resp.status_code in (200, 503)
            if resp.status_code == 503:
                assert resp.headers["Retry-After"].isdigit()
                assert resp.json()["error"]["type"] == "service_unavailable"

        _wait_serving(http, engine_pid)
        assert _restarts(http) == 1.0
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
        assert http.get("/health/ready").status_code == 200

    client = openai.OpenAI(
        base_url=doomed_server.base_url + "/v1", api_key="x", max_retries=0, timeout=GUARD_S
    )
    reply = client.chat.completions.create(
        model=doomed_server.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content is not None


def test_a_hung_engine_is_detected_and_replaced(doomed_server) -> None:
    """SIGSTOP: the process lives but answers nothing; after engine_hang_timeout_s its streams fail
    and the supervisor replaces it."""
    with httpx.Client(base_url=doomed_server.base_url, timeout=GUARD_S) as http:
        engine_pid = http.get("/v1/admin/stats").json()["engine_pid"]
        body = {"prompt": "Frozen:", "max_tokens": 230, "ignore_eos": True, "stream": True}
        started = time.monotonic()
        events = _stream_until(http, body, 2, lambda: os.kill(engine_pid, signal.SIGSTOP))
        assert time.monotonic() - started < GUARD_S
        assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
        assert "hung" in json.loads(events[-2])["error"]["message"]
        _wait_serving(http, engine_pid)
        assert _restarts(http) == 2.0
        with pytest.raises(ProcessLookupError):  # the frozen engine was reaped, not left behind
            for _ in range(100):
                os.kill(engine_pid, 0)
                time.sleep(0.1)


def test_past_the_restart_budget_the_supervisor_gives_up(doomed_server) -> None:
    with httpx.Client(base_url=doomed_server.base_url, timeout=GUARD_S) as http:
        engine_pid = http.get("/v1/admin/stats").json()["engine_pid"]
        os.kill(engine_pid, signal.SIGKILL)  # the third death: the budget is 2 restarts
        deadline = time.monotonic() + GUARD_S
        while (live := http.get("/health/live")).status_code != 503:
            assert time.monotonic() < deadline, live.text
            time.sleep(0.1)
        assert live.json()["error"]["code"] == "engine_failed"
        assert http.get("/health").json()["error"]["code"] == "engine_failed"
        assert http.get("/health/ready").status_code == 503
        resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"
        assert http.get("/v1/admin/stats").status_code == 503
        metrics = http.get("/metrics").text  # last known values, no hang
        assert 'xllm_engine_restart_gave_up{instance="local"} 1.0' in metrics
        assert "xllm_engine_available 0.0" in metrics
    assert "giving up" in doomed_server.log_tail(20000)
