"""Bad requests against the real server: each is a 4xx in OpenAI's error shape, and the server keeps serving.

Also: 401 (API key), 413 (body size), 429 (in-flight limit) on their own servers.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello"}]


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"prompt": "Hello world", "max_tokens": 4, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 4, **kw}


# (case id, path, JSON body or raw bytes, status, param (None: not checked), words the message must contain)
CASES: list[tuple[str, str, Any, int, str | None, str]] = [
    ("malformed-json", CMPL, b'{"prompt": "hi",', 400, None, "not valid JSON"),
    ("body-not-object", CMPL, [1, 2], 400, None, "JSON object"),
    (
        "prompt-missing",
        CMPL,
        {"max_tokens": 4},
        400,
        "prompt",
        "Either prompt or prompt_embeds must be provided",
    ),
    ("prompt-wrong-type", CMPL, cmpl(prompt=123), 400, "prompt", "prompt"),
    ("prompt-mixed-list", CMPL, cmpl(prompt=[1, "a"]), 400, "prompt", "prompt"),
    ("max-tokens-string", CMPL, cmpl(max_tokens="5"), 400, "max_tokens", "integer"),
    ("max-tokens-negative", CMPL, cmpl(max_tokens=-1), 400, "max_tokens", "positive"),
    ("max-tokens-zero", CMPL, cmpl(max_tokens=0), 400, "max_tokens", "positive"),
    ("max-tokens-huge", CMPL, cmpl(max_tokens=10**9), 400, "max_tokens", "maximum context length is 256"),
    ("max-tokens-float", CMPL, cmpl(max_tokens=4.5), 400, "max_tokens", "integer"),
    ("temperature-negative", CMPL, cmpl(temperature=-1), 400, "temperature", "[0, 100]"),
    ("temperature-string", CMPL, cmpl(temperature="hot"), 400, "temperature", "number"),
    ("top-p-zero", CMPL, cmpl(top_p=0), 400, "top_p", "(0, 1]"),
    ("top-p-above-one", CMPL, cmpl(top_p=1.5), 400, "top_p", "(0, 1]"),
    ("top-k-negative", CMPL, cmpl(top_k=-5), 400, "top_k", "top_k"),
    ("min-p-above-one", CMPL, cmpl(min_p=2), 400, "min_p", "[0, 1]"),
    ("n-zero", CMPL, cmpl(n=0), 400, "n", "[1, 16]"),
    ("n-huge", CMPL, cmpl(n=1000), 400, "n", "[1, 16]"),
    ("logprobs-99", CMPL, cmpl(logprobs=99), 400, "logprobs", "[0, 20]"),
    ("logprobs-negative", CMPL, cmpl(logprobs=-2), 400, "logprobs", "[0, 20]"),
    ("logprobs-whole-vocabulary", CMPL, cmpl(logprobs=-1), 400, "logprobs", "--max-logprobs"),
    ("prompt-empty-string", CMPL, cmpl(prompt=""), 400, "prompt", "empty"),
    ("prompt-empty-list", CMPL, cmpl(prompt=[]), 400, "prompt", "empty"),
    ("prompt-empty-id-list", CMPL, cmpl(prompt=[[]]), 400, "prompt", "empty"),
    (
        "prompt-too-long",
        CMPL,
        cmpl(prompt=[5] * 300, max_tokens=None),
        400,
        "prompt",
        "maximum context length",
    ),
    (
        "prompt-plus-tokens-too-long",
        CMPL,
        cmpl(prompt=[5] * 250, max_tokens=10),
        400,
        "max_tokens",
        "250 in the prompt",
    ),
    ("token-id-out-of-vocab", CMPL, cmpl(prompt=[1, 5000]), 400, "prompt", "out of vocabulary"),
    ("token-id-negative", CMPL, cmpl(prompt=[[3, -1]]), 400, "prompt", "out of vocabulary"),
    ("stop-list-too-long", CMPL, cmpl(stop=[f"s{i}" for i in range(17)]), 400, "stop", "at most 16"),
    ("stop-empty-string", CMPL, cmpl(stop=[""]), 400, "stop", "1..256"),
    ("stop-wrong-type", CMPL, cmpl(stop=5), 400, "stop", "stop"),
    ("stop-token-id-out-of-vocab", CMPL, cmpl(stop_token_ids=[99999]), 400, "stop_token_ids", "[0, 2048)"),
    ("seed-negative", CMPL, cmpl(seed=-1), 400, "seed", "seed"),
    ("presence-penalty-high", CMPL, cmpl(presence_penalty=3), 400, "presence_penalty", "[-2, 2]"),
    ("frequency-penalty-low", CMPL, cmpl(frequency_penalty=-3), 400, "frequency_penalty", "[-2, 2]"),
    ("repetition-penalty-zero", CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty", "(0, 10]"),
    ("min-tokens-over-max", CMPL, cmpl(min_tokens=10, max_tokens=4), 400, "min_tokens", "max_tokens"),
    ("stream-not-bool", CMPL, cmpl(stream="yes"), 400, "stream", "boolean"),
    (
        "stream-options-wrong-type",
        CMPL,
        cmpl(stream=True, stream_options="x"),
        400,
        "stream_options",
        "stream_options",
    ),
    ("priority-unknown", CMPL, cmpl(priority="urgent"), 400, "priority", "online"),
    ("prompt-logprobs-stream", CMPL, cmpl(stream=True, prompt_logprobs=1), 400, "prompt_logprobs", "stream"),
    ("unknown-model", CMPL, cmpl(model="gpt-5"), 404, "model", "does not exist"),
    ("chat-empty-messages", CHAT, chat(messages=[]), 400, "messages", "at least one"),
    ("chat-messages-not-list", CHAT, chat(messages="hi"), 400, "messages", "list"),
    (
        "chat-role-not-a-string",  # any string is a role (vLLM passes custom roles to the template)
        CHAT,
        chat(messages=[{"role": 7, "content": "x"}]),
        400,
        "messages.0.role",
        "string",
    ),
    (
        "chat-content-wrong-type",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages.0.content",
        "content",
    ),
    (
        "chat-image-part",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ]
        ),
        400,
        "messages.0.content.0.type",
        "not supported by this model",
    ),
    ("chat-top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "[0, 20]"),
    ("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    (
        "chat-max-completion-tokens-negative",
        CHAT,
        chat(max_completion_tokens=-5),
        400,
        "max_completion_tokens",
        "positive",
    ),
    ("chat-n-over-limit", CHAT, chat(n=17), 400, "n", "[1, 16]"),
    ("chat-unknown-model", CHAT, chat(model="nope"), 404, "model", "does not exist"),
    (
        "chat-prompt-too-long",
        CHAT,
        chat(messages=[{"role": "user", "content": "hello world " * 300}], max_tokens=None),
        400,
        "messages",
        "maximum context length",
    ),
    ("tokenize-nothing", "/tokenize", {}, 400, "prompt", "exactly one"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [1, 99999]}, 400, "tokens", "out of vocabulary"),
    ("unknown-route", "/v1/nothing-here", {}, 404, None, "Not Found"),
    ("body-too-large", CMPL, cmpl(prompt="a" * (70 * 1024)), 413, None, "exceeds the limit"),
]


def _post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(
        path, json={k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body
    )


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None, words: str = "") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err
    return err


def test_at_least_30_cases() -> None:
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("path,body,status,param,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(
    http: httpx.Client, path: str, body: Any, status: int, param: str | None, words: str
) -> None:
    err = assert_openai_error(_post(http, path, body), status, param, words)
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"
    if "context length" in words:
        assert err["code"] == "context_length_exceeded"


def test_context_length_message_gives_the_numbers(http: httpx.Client) -> None:
    err = assert_openai_error(_post(http, CMPL, cmpl(prompt=[7] * 200, max_tokens=100)), 400, "max_tokens")
    assert "maximum context length is 256 tokens" in err["message"]
    assert "you requested 300 tokens (200 in the prompt, 100 in the completion)" in err["message"]


def test_body_too_large_by_content_length_header_only(server) -> None:
    """A declared length over the limit is refused before any byte of the body is read."""
    head = (
        f"POST {CMPL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10 * 1024 * 1024}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    assert b" 413 " in status_line, data[:200]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_too_large"


def test_server_still_serves_after_bad_requests(http: httpx.Client) -> None:
    for _, path, body, *_ in CASES[:5]:
        _post(http, path, body)
    resp = http.post(CMPL, json=cmpl(temperature=0))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
    metrics = http.get("/metrics").text
    assert 'xllm_request_errors_total{code="400"}' in metrics


def test_openai_client_sees_bad_request(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model_name, prompt="hi", max_tokens=4, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER, max_tokens=4)


# ---------------------------------------------------------------- API key and the in-flight limit

API_KEY = "sk-test-0123456789"
MAX_PENDING = 2


@pytest.fixture(scope="module")
def guarded_server(model_dir, launch_server) -> Iterator[Any]:
    """A server with an API key and a tiny in-flight limit (one process pair for both features)."""
    handle = launch_server(model_dir, {"api_key": API_KEY, "max_pending_requests": MAX_PENDING})
    yield handle
    handle.stop()


@pytest.mark.parametrize(
    "headers,words",
    [
        ({}, "missing"),
        ({"Authorization": "Bearer wrong-key"}, "incorrect"),
        ({"Authorization": f"Basic {API_KEY}"}, "missing"),
        ({"Authorization": f"Bearer {API_KEY}x"}, "incorrect"),
    ],
    ids=["missing", "wrong", "wrong-scheme", "longer"],
)
def test_api_key_required(guarded_server, headers: dict[str, str], words: str) -> None:
    with httpx.Client(base_url=guarded_server.base_url, timeout=30) as client:
        for method, path in [("POST", CMPL), ("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics")]:
            body = json.dumps(cmpl()).encode() if method == "POST" else None
            resp = client.request(method, path, content=body, headers=headers)
            err = assert_openai_error(resp, 401, None, words)
            assert err["type"] == "authentication_error"


def test_api_key_accepted_and_health_open(guarded_server) -> None:
    with httpx.Client(base_url=guarded_server.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health/ready").status_code == 200
    client = openai.OpenAI(
        base_url=guarded_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
    )
    out = client.completions.create(
        model=guarded_server.model_name, prompt="Hello", max_tokens=3, temperature=0
    )
    assert 1 <= out.usage.completion_tokens <= 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded_server.base_url + "/v1", api_key="bad", max_retries=0).models.list()


def test_api_key_401_is_documented_except_on_probes(guarded_server) -> None:
    """With an API key, /openapi.json documents 401 (OpenAI's error object) on every route but the health
    probes, which need no key."""
    with guarded_server.client() as client:
        spec = client.get("/openapi.json").json()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if path.startswith("/health"):
                assert "401" not in op["responses"], (method, path)
            else:
                schema = op["responses"]["401"]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)


def test_too_many_requests_get_429(guarded_server) -> None:
    async def flood() -> list[httpx.Response]:
        body = cmpl(prompt="Once upon a time", max_tokens=200, ignore_eos=True, temperature=0)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(
            base_url=guarded_server.base_url, headers=headers, timeout=120
        ) as client:
            return list(await asyncio.gather(*(client.post(CMPL, json=body) for _ in range(12))))

    responses = asyncio.run(asyncio.wait_for(flood(), 300))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
    assert set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"].isdigit()
            assert_openai_error(r, 429, None, "too many requests")
    # The limit frees up: a new request succeeds once the flood is done.
    with guarded_server.client() as client:
        assert client.post(CMPL, json=cmpl()).status_code == 200
