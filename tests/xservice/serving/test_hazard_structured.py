"""Hazard corpus, structured outputs: the requests that killed or bloated the service on a real server.

- A chain of 3,000 Lark rules (``structured_outputs.grammar`` / ``guided_grammar``) or 3,000 ``$ref``
  links (``response_format``) overflowed llguidance's stack inside the API server: SIGSEGV, service
  and engine gone. They are 400s naming the field, online, in a batch file, and after a restart with
  such lines still pending.
- ``structured_outputs.json`` as a string nested ~900 levels was a ``RecursionError`` (a 500).
- Tiny regexes such as ``b{2147483647}`` each pinned ~90 MiB in the engine's compiled-grammar cache;
  the engine's memory now stays within the cache's measured budget however many distinct ones come.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.xservice.batch.helpers import (
    completion_line,
    openai_client,
    read_file,
    submit,
    wait_batch,
    write_jsonl,
)
from tests.xservice.conftest import ServerHandle, start_server


def rule_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "y"\n'


def ref_chain_schema(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_schema_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}
# (endpoint, body, the field the 400 must name): every spelling that reached the crashing validator
HAZARDS = [
    (
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"grammar": rule_chain(3000)}},
        "structured_outputs",
    ),
    ("/v1/completions", {**COMPLETION, "guided_grammar": rule_chain(3000)}, "guided_grammar"),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": ref_chain_schema(3000)},
            },
        },
        "response_format",
    ),
    ("/v1/completions", {**COMPLETION, "guided_json": ref_chain_schema(3000)}, "guided_json"),
    (
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"json": nested_schema_text(950)}},
        "structured_outputs",
    ),
]
GREEDY = {"prompt": "The weather today", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hazard_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    data_dir = tmp_path_factory.mktemp("hazard-batch")
    engine = {
        "structured_outputs": {"cache_mib": 96, "max_compiled_mib": 64},
        "batch": {"data_dir": str(data_dir), "max_concurrent_lines": 1},
    }
    handle = start_server(model_dir, {"max_body_bytes": 4 << 20}, engine=engine)
    yield handle
    handle.stop()


def _text(http: httpx.Client, body: dict[str, Any]) -> str:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("endpoint,body,param", HAZARDS, ids=lambda v: v if isinstance(v, str) else "")
def test_payloads_that_crashed_the_service_are_400s_naming_the_field(
    hazard_server: ServerHandle, endpoint: str, body: dict[str, Any], param: str
) -> None:
    with hazard_server.client(timeout=120) as http:
        before = _text(http, GREEDY)
        streamed: list[str] = []
        stream = threading.Thread(target=lambda: streamed.append(_text(http, GREEDY)))
        stream.start()  # a request in flight while the hazard arrives
        r = http.post(endpoint, json=body)
        stream.join(120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert hazard_server.proc.poll() is None and http.get("/health").status_code == 200
        assert streamed == [before] and _text(http, GREEDY) == before


def test_the_same_payloads_in_a_batch_file_fail_their_lines_and_survive_a_restart(
    model_dir: Path, tmp_path: Path
) -> None:
    lines = [completion_line(f"ok-{i}", f"Line {i} says", max_tokens=64, ignore_eos=True) for i in range(6)]
    hazards = [(body, param) for endpoint, body, param in HAZARDS if endpoint == "/v1/completions"]
    for i, (body, _) in enumerate(hazards):
        lines.append({"custom_id": f"hazard-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    data_dir = tmp_path / "batch-data"
    settings = {"batch": {"data_dir": str(data_dir), "max_concurrent_lines": 1}}

    first = start_server(model_dir, {"max_body_bytes": 4 << 20}, engine=settings)
    try:
        client = openai_client(first)
        batch_id = submit(client, path, "/v1/completions").id
        wait_batch(client, batch_id, until=lambda b: b.request_counts.completed >= 2)
        os.kill(first.proc.pid, signal.SIGKILL)  # the hazard lines are still pending: they resume
        first.proc.wait(60)
    finally:
        first.stop()

    second = start_server(model_dir, {"max_body_bytes": 4 << 20}, engine=settings)
    try:
        client = openai_client(second)
        batch = wait_batch(client, batch_id)  # resumed at start-up, with the hazard lines pending
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (len(lines), 6, len(hazards))
        errors = {r["custom_id"]: r["response"] for r in read_file(client, batch.error_file_id)}
        assert set(errors) == {f"hazard-{i}" for i in range(len(hazards))}
        for i, (_, param) in enumerate(hazards):
            assert errors[f"hazard-{i}"]["status_code"] == 400
            assert errors[f"hazard-{i}"]["body"]["error"]["param"] == param
        outputs = read_file(client, batch.output_file_id)
        assert sorted(r["custom_id"] for r in outputs) == [f"ok-{i}" for i in range(6)]
        assert second.proc.poll() is None
        with second.client() as http:
            assert http.get("/health").status_code == 200
    finally:
        second.stop()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def _pathological_regexes(start: int, count: int) -> list[str]:
    """Distinct tiny regexes with huge compiled states: half under the 64 MiB limit (~40 MiB each:
    accepted and cached), half over it (~90 MiB: refused after measuring)."""
    out = []
    for i in range(start, start + count):
        letter = "abcdefghijklmnopqrstuvwxyz"[i % 26]
        out.append(f"({letter}{{1000}}){{{100 + i // 26}}}" if i % 2 else f"{letter}{{{2**31 - 1 - i}}}")
    return out


def _send_regexes(http: httpx.Client, regexes: list[str]) -> dict[int, int]:
    statuses: dict[int, int] = {}
    for regex in regexes:
        body = {**COMPLETION, "max_tokens": 1, "structured_outputs": {"regex": regex}}
        r = http.post("/v1/completions", json=body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "structured_outputs"
            assert "over this server's limit of 64 MiB" in r.json()["error"]["message"], r.text
    return statuses


def _check_regex_memory(hazard_server: ServerHandle, num_regexes: int) -> dict[str, float]:
    with hazard_server.client(timeout=300) as http:
        pid = http.get("/v1/admin/stats").json()["engine_pid"]
        # fill the cache (96 MiB: two of the accepted grammars) so its budget is reached
        assert _send_regexes(http, _pathological_regexes(0, 8)) == {200: 4, 400: 4}
        warm = _rss_mib(pid)
        statuses = _send_regexes(http, _pathological_regexes(8, num_regexes))
        grown = _rss_mib(pid) - warm
    assert statuses == {200: num_regexes // 2, 400: num_regexes // 2}
    # without the bound each accepted regex stays cached (~40 MiB each) and each refused one was
    # cached too (~90 MiB); with it the cache holds at most its budget, however many come
    assert grown < 96, f"engine RSS grew {grown:.0f} MiB over {num_regexes} regexes past a warm cache"
    return {"warm_rss_mib": warm, "growth_mib": grown}


def test_distinct_pathological_regexes_leave_engine_memory_bounded(hazard_server: ServerHandle) -> None:
    print(json.dumps(_check_regex_memory(hazard_server, 16)))


@pytest.mark.slow
def test_100_distinct_pathological_regexes_leave_engine_memory_bounded(hazard_server: ServerHandle) -> None:
    print(json.dumps(_check_regex_memory(hazard_server, 100)))
