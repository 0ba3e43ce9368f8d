"""Through the HTTP API, async scheduling changes nothing a client sees: stop strings, max_tokens,
n > 1 (seeded), logprobs and a stream the client leaves early give the same results with it on and off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.xservice.conftest import ServerHandle, start_server

PROMPTS = ["Once upon a time", "The history of the sea", "A list of numbers: 1, 2, 3,", "Hello"]


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[dict[str, ServerHandle]]:
    handles = {}
    try:
        for mode in ("off", "on"):
            handles[mode] = start_server(model_dir, engine={"execution": {"async_scheduling": mode}})
        yield handles
    finally:
        for h in handles.values():
            h.stop()


def _bodies(stop_text: dict[str, str]) -> list[dict]:
    out = []
    for p in PROMPTS:
        out.append(
            {"prompt": p, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop_text[p]]}
        )
        out.append({"prompt": p, "max_tokens": 7, "temperature": 0})
        out.append(
            {"prompt": p, "max_tokens": 12, "temperature": 0.9, "seed": 11, "n": 3, "presence_penalty": 0.7}
        )
        out.append({"prompt": p, "max_tokens": 9, "temperature": 0, "logprobs": 2, "ignore_eos": True})
    return out


def _complete(http: httpx.Client, body: dict) -> list:
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return [(c["index"], c["text"], c["finish_reason"], c.get("logprobs")) for c in resp.json()["choices"]]


def _stream_text(http: httpx.Client, body: dict, leave_after: int | None = None) -> list[str]:
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(line)
                if leave_after is not None and len(chunks) >= leave_after:
                    break  # the client goes away: the server aborts the request
    return chunks


def test_client_visible_output_is_the_same(servers: dict[str, ServerHandle]) -> None:
    with servers["off"].client() as off, servers["on"].client() as on:
        # a stop string inside each greedy continuation (taken from the sync server's output)
        stop_text = {}
        for p in PROMPTS:
            text = _complete(off, {"prompt": p, "max_tokens": 30, "temperature": 0, "ignore_eos": True})[0][1]
            stop_text[p] = text[len(text) // 2 : len(text) // 2 + 3] or text
        for body in _bodies(stop_text):
            assert _complete(on, body) == _complete(off, body), body
        body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        for http in (on, off):  # leave a stream early; the next identical request is unaffected
            assert len(_stream_text(http, body, leave_after=3)) == 3
        assert _complete(on, body) == _complete(off, body)
        for mode, http in (("on", on), ("off", off)):
            stats = http.get("/v1/admin/stats").json()
            assert stats["async_scheduling"] is (mode == "on")
