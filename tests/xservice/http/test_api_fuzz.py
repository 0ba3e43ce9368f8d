"""Property-based fuzzing of every POST route of a real server, from its own ``/openapi.json``.

Three kinds of requests per route (schemathesis builds them from the schema, hypothesis drives it,
derandomized so every run sends the same requests):

- ``positive``: bodies that match the schema (many are still refused: the API checks more than the schema);
- ``negative``: bodies that violate it (wrong types, missing fields, ...);
- ``hazard``: a schema-valid JSON body with one value replaced or added anywhere by one the service cannot
  carry (a lone surrogate, an integer outside int64, NaN / Infinity).

Properties: no 5xx (a 503 from a dead engine included); every 4xx is OpenAI's error object; a hazard is
a 400 naming where it is; every answer conforms to ``/openapi.json`` (schemathesis' status code, content
type, response schema and header checks), as does every answer of the GET and DELETE routes. Afterwards the same engine still serves, and ``/metrics`` counted no 5xx.
``FUZZ_EXAMPLES`` per route and kind keeps the default run to about a minute on two cores; the ``slow``
variant (``XLLM_FUZZ_LONG=1``) sends ``LONG_EXAMPLES``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

FUZZ_EXAMPLES = 250
LONG_EXAMPLES = 2000
REQUEST_TIMEOUT_S = 120.0  # guards against a hang, not a timing assertion

POST_ROUTES = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/invocations",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/responses/{response_id}/cancel",
    "/tokenize",
    "/detokenize",
    "/v1/files",
    "/v1/batches",
    "/v1/batches/{batch_id}/cancel",
    "/v1/rec/catalogs",
    "/v1/rec/generate",
    "/v1/admin/instances/{name}/role",  # single node: a 400 (no dynamic PD) for every valid body
)
NO_JSON_BODY = {
    "/v1/files",
    "/v1/batches/{batch_id}/cancel",
    "/v1/responses/{response_id}/cancel",
}  # multipart; none (path parameter only)
KINDS = ("positive", "negative", "hazard")
# Every answer is documented in /openapi.json: its status, content type, body schema and headers.
CONFORMANCE_CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]

HAZARDS: tuple[Any, ...] = (
    "\ud800",
    "ok\udfffok",
    2**64,
    2**63,
    -(2**63) - 1,
    10**30,
    float("nan"),
    float("inf"),
    float("-inf"),
)


def fuzz_cases() -> list[Any]:
    cases = []
    for path in POST_ROUTES:
        for kind in KINDS:
            if path in NO_JSON_BODY and kind != "positive":
                # Nothing to break in a path parameter (any text is a valid id); multipart bodies are
                # not JSON, so they carry no JSON hazards and their negative cases cannot be encoded.
                continue
            cases.append(pytest.param(path, kind, id=f"{path}-{kind}"))
    return cases


# ---------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def fuzz_server(launch_server, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Its own server: batch files in a temporary folder, short generations (max_model_len 64, n <= 2),
    prompt embeddings and runtime LoRA loading on."""
    settings_ = launch_server.__globals__["ENGINE_SETTINGS"]  # the config the launcher writes
    saved = {k: dict(v) for k, v in settings_.items()}
    settings_["batch"] = {"data_dir": str(tmp_path_factory.mktemp("fuzz-batch"))}
    settings_["model"] = {**settings_["model"], "max_model_len": 64, "enable_prompt_embeds": True}
    settings_["lora"] = {
        "enable_lora": True,
        "allow_runtime_lora_updating": True,
    }  # the LoRA routes fuzzed for real
    try:
        handle = launch_server(model_dir, {"max_n": 2, "max_body_bytes": 256 * 1024})
    finally:
        settings_.clear()
        settings_.update(saved)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def spec(fuzz_server: Any) -> dict[str, Any]:
    with fuzz_server.client() as http:
        return http.get("/openapi.json").json()


@pytest.fixture(scope="module")
def engine_pid(fuzz_server: Any) -> int:
    with fuzz_server.client() as http:
        return http.get("/v1/admin/stats").json()["engine_pid"]


@pytest.fixture(scope="module")
def schema(spec: dict[str, Any]) -> Any:
    return schemathesis.openapi.from_dict(spec)


# ---------------------------------------------------------------------- properties


def assert_error_shape(status: int, text: str) -> dict[str, Any]:
    assert status < 500, f"{status}: {text[:2000]}"
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], text[:2000]
    return err


def unsafe_paths(value: Any, path: tuple = ()) -> set[str]:
    """Every place in ``value`` holding something the service must refuse (a test oracle, written apart)."""
    out: set[str] = set()
    here = ".".join(str(p) for p in path)
    if isinstance(value, str) and re.search("[\ud800-\udfff]", value):
        out.add(here)
    elif isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        out.add(here)
    elif isinstance(value, float) and not math.isfinite(value):
        out.add(here)
    elif isinstance(value, dict):
        for key, item in value.items():
            if re.search("[\ud800-\udfff]", key):
                out.add(".".join(str(p) for p in (*path, key.encode("utf-8", "backslashreplace").decode())))
            out |= unsafe_paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out |= unsafe_paths(item, (*path, i))
    return out


def places(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, bool]]:
    """``(path, is_object)`` of every node under ``value``; a hazard replaces a node or joins an object."""
    yield path, isinstance(value, dict)
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in children:
        yield from places(item, (*path, key))


def with_hazard(body: dict[str, Any], path: tuple, hazard: Any, new_key: str | None) -> dict[str, Any]:
    """A copy of ``body`` with ``hazard`` at ``path`` (or under ``new_key`` in the object at ``path``)."""
    body = json.loads(json.dumps(body))
    if new_key is not None:
        path = (*path, new_key)
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = hazard
    return body


def run_fuzz(schema: Any, base_url: str, path: str, kind: str, max_examples: int) -> None:
    operation = schema[path]["POST"]
    mode = GenerationMode.NEGATIVE if kind == "negative" else GenerationMode.POSITIVE
    session = requests.Session()
    http = httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
    statuses: dict[int, int] = {}

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        print_blob=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def check(case: Any, data: st.DataObject) -> None:
        if kind != "hazard":
            resp = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            if resp.status_code >= 400:
                assert_error_shape(resp.status_code, resp.text)
            case.validate_response(resp, checks=CONFORMANCE_CHECKS)
            return
        body = case.body if isinstance(case.body, dict) else {}
        spots = list(places(body))
        spot, is_object = spots[data.draw(st.integers(0, len(spots) - 1), label="place")]
        new_key = (
            data.draw(st.sampled_from(["extra", "prompt", "n", "ü"]), label="key") if is_object else None
        )
        if not spot and new_key is None:
            return
        hazard = data.draw(st.sampled_from(HAZARDS), label="hazard")
        sent = with_hazard(body, spot, hazard, new_key)
        text = json.dumps(sent)  # lone surrogates as \\ud800 escapes, non-finite floats as NaN / Infinity
        resp = http.post(path, content=text.encode(), headers={"Content-Type": "application/json"})
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        err = assert_error_shape(resp.status_code, resp.text)
        assert resp.status_code == 400, resp.text
        assert "400" in operation.responses.status_codes, "a hazard's 400 is documented"
        # A field named "" has no name to give: param is null then.
        assert err["param"] in {p or None for p in unsafe_paths(sent)}, (err, text[:2000])

    try:
        check()
    finally:
        session.close()
        http.close()
    print(f"fuzz {path} {kind}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= max_examples // 2, statuses  # the strategy really generated requests


# ---------------------------------------------------------------------- tests (the last one checks the server)


def test_fuzz_covers_every_post_route(spec: dict[str, Any]) -> None:
    documented = {path for path, ops in spec["paths"].items() if "post" in ops}
    assert documented == set(POST_ROUTES), "add new POST routes to POST_ROUTES (and fuzz them)"
    for path in POST_ROUTES:
        assert "requestBody" in spec["paths"][path]["post"] or "{" in path, path


@pytest.mark.parametrize("path,kind", fuzz_cases())
def test_fuzz_post_route(schema: Any, fuzz_server: Any, engine_pid: int, path: str, kind: str) -> None:
    run_fuzz(schema, fuzz_server.base_url, path, kind, FUZZ_EXAMPLES)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("XLLM_FUZZ_LONG"), reason="long fuzz run: set XLLM_FUZZ_LONG=1")
@pytest.mark.parametrize("path,kind", fuzz_cases())
def test_fuzz_post_route_long(schema: Any, fuzz_server: Any, engine_pid: int, path: str, kind: str) -> None:
    run_fuzz(schema, fuzz_server.base_url, path, kind, LONG_EXAMPLES)


OTHER_EXAMPLES = 20  # per operation and kind: these routes take only path and query parameters


def other_operations(spec: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted(
        (method.upper(), path) for path, ops in spec["paths"].items() for method in ops if method != "post"
    )


def call_and_check(operation: Any, mode: GenerationMode, base_url: str, seen: dict[int, int]) -> None:
    session = requests.Session()

    @settings(
        max_examples=OTHER_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        resp = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        if resp.status_code >= 400:
            assert_error_shape(resp.status_code, resp.text)
        case.validate_response(resp, checks=CONFORMANCE_CHECKS)

    try:
        check()
    except Unsatisfiable:
        assert mode == GenerationMode.NEGATIVE, "positive cases can always be generated"
        # only string path parameters: no value of them violates the schema
    finally:
        session.close()


def test_fuzz_other_routes_conform(schema: Any, spec: dict[str, Any], fuzz_server: Any) -> None:
    """GET and DELETE routes (ids, query parameters): every answer is documented and none is a 5xx."""
    statuses: dict[str, dict[int, int]] = {}
    for method, path in other_operations(spec):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            seen = statuses.setdefault(f"{method} {path} {mode.value}", {})
            call_and_check(schema[path][method], mode, fuzz_server.base_url, seen)
    print(f"fuzz other routes: {statuses}")
    assert all(n for key, n in statuses.items() if key.endswith("positive")), statuses  # each was called


BATCH_FILE_EXAMPLES = 100
BATCH_ERROR_CODES = {"invalid_file_format", "invalid_json_line", "empty_file"}


def batch_lines(schema: Any) -> st.SearchStrategy[bytes]:
    """One line of a batch input file: a request (schema-valid body, maybe with a hazard), JSON that is not
    a request, or bytes that are not JSON at all."""
    bodies = schema["/v1/completions"]["POST"].as_strategy().map(lambda case: case.body)
    hazardous = st.tuples(bodies, st.sampled_from(HAZARDS)).map(lambda b: {**b[0], "seed": b[1]})
    request = st.tuples(st.text(max_size=8), st.one_of(bodies, hazardous)).map(
        lambda r: {"custom_id": r[0], "method": "POST", "url": "/v1/completions", "body": r[1]}
    )
    as_json = st.one_of(request, st.sampled_from(HAZARDS), st.lists(st.integers(), max_size=3))
    return st.one_of(as_json.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64))


def upload(http: httpx.Client, data: bytes) -> str | None:
    """The uploaded file's id; None when the upload is refused as no batch input file (checked at upload)."""
    files = {"file": ("in.jsonl", data), "purpose": (None, "batch")}
    resp = http.post("/v1/files", files=files)
    if resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_batch_file":
        return None
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def test_fuzz_batch_input_files(schema: Any, fuzz_server: Any, engine_pid: int) -> None:
    """Whatever the input file holds, it is refused at upload (a line is no batch request line), or its
    batch ends completed (each line answered) or failed validation."""
    http = fuzz_server.client(timeout=REQUEST_TIMEOUT_S)
    final: dict[str, int] = {}

    @settings(
        max_examples=BATCH_FILE_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(lines=st.lists(batch_lines(schema), min_size=1, max_size=4))
    def check(lines: list[bytes]) -> None:
        data = b"\n".join(lines)
        if not data.strip():
            return  # an empty upload is refused by POST /v1/files itself
        file_id = upload(http, data)
        if file_id is None:
            final["refused at upload"] = final.get("refused at upload", 0) + 1
            return
        resp = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"})
        assert resp.status_code == 200, resp.text
        batch = resp.json()
        while batch["status"] not in ("completed", "failed"):
            assert batch["status"] in ("validating", "in_progress", "finalizing"), batch
            time.sleep(0.05)
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        final[batch["status"]] = final.get(batch["status"], 0) + 1
        counts = batch["request_counts"]
        if batch["status"] == "failed":
            assert {e["code"] for e in batch["errors"]["data"]} <= BATCH_ERROR_CODES, batch
            assert counts["total"] == 0, batch
        else:
            assert counts["total"] == counts["completed"] + counts["failed"] >= 1, batch

    try:
        check()
    finally:
        http.close()
    print(f"fuzz batch input files: {sum(final.values())} batches, {final}")
    assert final.get("completed") and (final.get("failed") or final.get("refused at upload")), final


def test_server_still_serves_after_fuzzing(fuzz_server: Any, engine_pid: int) -> None:
    with fuzz_server.client() as http:
        assert http.get("/health/ready").status_code == 200
        resp = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
        assert (
            http.get("/v1/admin/stats").json()["engine_pid"] == engine_pid
        )  # the same engine, never restarted
        metrics = http.get("/metrics").text
    server_errors = re.findall(r'xllm_request_errors_total\{code="5\d\d"\} (\S+)', metrics)
    tracebacks = [line for line in fuzz_server.log_tail(200_000).splitlines() if "unhandled error" in line]
    assert all(float(n) == 0 for n in server_errors), (server_errors, tracebacks[:5], fuzz_server.log_tail())
