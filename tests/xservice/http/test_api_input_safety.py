"""JSON the service cannot carry (lone surrogates, integers outside int64, NaN / Infinity) gets a 400 naming
the field on every POST route, and the keep-alive connection that sent it keeps serving.

Bodies are hand-written JSON text: ``"\\ud800"`` is what ``json.dumps`` writes for a lone surrogate.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.xservice.http.test_api_errors import assert_openai_error

S = '"\\ud800"'  # a lone high surrogate, as JSON text
BIG = str(2**64)  # msgspec (the engine frames) cannot encode it
OVER = str(2**63)  # just past int64
UNDER = str(-(2**63) - 1)
MSG = '{"role": "user", "content": "hi"}'

# (case id, path, JSON text, param)
CASES: list[tuple[str, str, str, str]] = [
    ("cmpl-prompt", "/v1/completions", f'{{"prompt": {S}}}', "prompt"),
    ("cmpl-prompt-list", "/v1/completions", f'{{"prompt": ["ok", {S}]}}', "prompt.1"),
    ("cmpl-stop", "/v1/completions", f'{{"prompt": "hi", "stop": {S}}}', "stop"),
    ("cmpl-stop-list", "/v1/completions", f'{{"prompt": "hi", "stop": ["a", {S}]}}', "stop.1"),
    ("cmpl-suffix", "/v1/completions", f'{{"prompt": "hi", "suffix": {S}}}', "suffix"),
    ("cmpl-model", "/v1/completions", f'{{"prompt": "hi", "model": {S}}}', "model"),
    ("cmpl-user", "/v1/completions", f'{{"prompt": "hi", "user": {S}}}', "user"),
    ("cmpl-top-k", "/v1/completions", f'{{"prompt": "hi", "top_k": {BIG}}}', "top_k"),
    ("cmpl-seed", "/v1/completions", f'{{"prompt": "hi", "seed": {BIG}}}', "seed"),
    ("cmpl-max-tokens", "/v1/completions", f'{{"prompt": "hi", "max_tokens": {BIG}}}', "max_tokens"),
    ("cmpl-n", "/v1/completions", f'{{"prompt": "hi", "n": {BIG}}}', "n"),
    ("cmpl-min-tokens", "/v1/completions", f'{{"prompt": "hi", "min_tokens": {UNDER}}}', "min_tokens"),
    ("cmpl-logprobs", "/v1/completions", f'{{"prompt": "hi", "logprobs": {OVER}}}', "logprobs"),
    ("cmpl-token-ids", "/v1/completions", f'{{"prompt": [1, {BIG}]}}', "prompt.1"),
    ("cmpl-token-id-lists", "/v1/completions", f'{{"prompt": [[1], [2, {UNDER}]]}}', "prompt.1.1"),
    ("cmpl-stop-token-ids", "/v1/completions", f'{{"prompt": "hi", "stop_token_ids": [{BIG}]}}', "stop_token_ids.0"),
    ("cmpl-beam-width", "/v1/completions", f'{{"prompt": "hi", "beam_width": {BIG}}}', "beam_width"),
    ("cmpl-temperature-nan", "/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("cmpl-top-p-overflow", "/v1/completions", '{"prompt": "hi", "top_p": 1e400}', "top_p"),
    ("cmpl-penalty-infinity", "/v1/completions", '{"prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
    ("cmpl-temperature-big-int", "/v1/completions", f'{{"prompt": "hi", "temperature": {BIG}}}', "temperature"),
    ("cmpl-unknown-field", "/v1/completions", f'{{"prompt": "hi", "extra": {{"x": {S}}}}}', "extra.x"),
    ("cmpl-stream-options", "/v1/completions", f'{{"prompt": "hi", "stream_options": {{"x": {BIG}}}}}', "stream_options.x"),
    ("chat-content", "/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {S}}}]}}', "messages.0.content"),
    (
        "chat-content-part",
        "/v1/chat/completions",
        f'{{"messages": [{MSG}, {{"role": "user", "content": [{{"type": "text", "text": {S}}}]}}]}}',
        "messages.1.content.0.text",
    ),
    ("chat-name", "/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "x", "name": {S}}}]}}', "messages.0.name"),
    ("chat-stop", "/v1/chat/completions", f'{{"messages": [{MSG}], "stop": [{S}]}}', "stop.0"),
    ("chat-seed", "/v1/chat/completions", f'{{"messages": [{MSG}], "seed": {BIG}}}', "seed"),
    ("chat-top-logprobs", "/v1/chat/completions", f'{{"messages": [{MSG}], "top_logprobs": {BIG}}}', "top_logprobs"),
    ("chat-max-completion-tokens", "/v1/chat/completions", f'{{"messages": [{MSG}], "max_completion_tokens": {OVER}}}', "max_completion_tokens"),
    ("tokenize-prompt", "/tokenize", f'{{"prompt": {S}}}', "prompt"),
    ("tokenize-messages", "/tokenize", f'{{"messages": [{{"role": "user", "content": {S}}}]}}', "messages.0.content"),
    ("detokenize-tokens", "/detokenize", f'{{"tokens": [1, {BIG}]}}', "tokens.1"),
    ("rec-generate-prompt", "/v1/rec/generate", f'{{"prompt": {S}, "catalog": "c"}}', "prompt"),
    ("rec-generate-catalog", "/v1/rec/generate", f'{{"prompt": "hi", "catalog": {S}}}', "catalog"),
    ("rec-generate-prompt-ids", "/v1/rec/generate", f'{{"prompt": [{BIG}], "catalog": "c"}}', "prompt.0"),
    ("rec-generate-beam-width", "/v1/rec/generate", f'{{"prompt": "hi", "catalog": "c", "beam_width": {BIG}}}', "beam_width"),
    ("rec-catalog-items", "/v1/rec/catalogs", f'{{"name": "c", "items": [[1, 2], [3, {BIG}]]}}', "items.1.1"),
    ("rec-catalog-name", "/v1/rec/catalogs", f'{{"name": {S}, "items": [[1]]}}', "name"),
    ("batch-file-id", "/v1/batches", f'{{"input_file_id": {S}, "endpoint": "/v1/completions"}}', "input_file_id"),
    (
        "batch-metadata",
        "/v1/batches",
        f'{{"input_file_id": "f", "endpoint": "/v1/completions", "metadata": {{"k": {S}}}}}',
        "metadata.k",
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def conn(server) -> Iterator[httpx.Client]:
    """One keep-alive connection: every request of the module goes over the same socket."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60, limits=limits) as client:
        yield client


def local_port(resp: httpx.Response) -> int:
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize("path,text,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_unsafe_json_is_a_400_naming_the_field(conn: httpx.Client, path: str, text: str, param: str) -> None:
    resp = conn.post(path, content=text.encode(), headers={"Content-Type": "application/json"})
    err = assert_openai_error(resp, 400, param)
    assert err["type"] == "invalid_request_error"
    assert resp.headers.get("connection") != "close"
    # The same connection serves a normal request afterwards.
    ok = conn.post("/tokenize", json={"prompt": "hello"})
    assert ok.status_code == 200, ok.text
    assert local_port(ok) == local_port(resp)


def test_int64_limits_themselves_are_served(conn: httpx.Client) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "top_k": 2**63 - 1, "seed": 2**63 - 1}
    resp = conn.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    ok = conn.post("/detokenize", json={"tokens": [1, 2]})
    assert ok.status_code == 200


def test_valid_surrogate_pairs_and_non_ascii_are_served(conn: httpx.Client) -> None:
    text = '{"prompt": "caf\\u00e9 \\ud83d\\ude00"}'  # an escaped pair is one emoji
    resp = conn.post("/tokenize", content=text.encode(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text
    resp = conn.post("/v1/completions", content=text.encode(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text


def test_upload_with_a_non_utf8_part_header_is_a_400(conn: httpx.Client) -> None:
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="\xff\xfe.jsonl"\r\n\r\n{}\r\n--b--\r\n'
    )
    resp = conn.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    err = assert_openai_error(resp, 400, None, "UTF-8")
    assert err["code"] == "invalid_body"
    assert conn.post("/tokenize", json={"prompt": "hello"}).status_code == 200
