"""Kill the engine process under a live server: streams end with an error event, then everything is 503."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

GUARD_S = 60.0  # keeps a broken build from hanging the suite; not a timing assertion


@pytest.fixture(scope="module")
def doomed_server(model_dir, launch_server) -> Iterator[object]:
    handle = launch_server(model_dir, {}, via_cli=True)
    yield handle
    handle.stop()


def test_engine_killed_mid_stream(doomed_server) -> None:
    with httpx.Client(base_url=doomed_server.base_url, timeout=GUARD_S) as http:
        engine_pid = http.get("/v1/admin/stats").json()["engine_pid"]
        assert engine_pid != doomed_server.proc.pid
        body = {"prompt": "A very long story:", "max_tokens": 230, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    os.kill(engine_pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and error["message"]

        assert http.get("/health").status_code == 200  # the service process itself is fine
        deadline = time.monotonic() + GUARD_S
        while (ready := http.get("/health/ready")).status_code != 503:
            assert time.monotonic() < deadline, ready.text
            time.sleep(0.1)
        assert ready.json()["error"]["code"] == "engine_unavailable"

        resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert resp.status_code == 503 and resp.headers["Retry-After"].isdigit()
        assert resp.json()["error"]["type"] == "service_unavailable"
        assert http.get("/v1/admin/stats").status_code == 503
        assert http.get("/metrics").status_code == 200  # last known values, no hang

    client = openai.OpenAI(
        base_url=doomed_server.base_url + "/v1", api_key="x", max_retries=0, timeout=GUARD_S
    )
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model=doomed_server.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert info.value.status_code == 503
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=doomed_server.model_name, prompt="Hi", max_tokens=2, stream=True)
    assert info.value.status_code == 503
