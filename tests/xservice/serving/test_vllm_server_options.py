"""vLLM's server options and routes a client relies on, each tested as vLLM's own test of it does
(``tests/entrypoints/openai/...`` and ``tests/entrypoints/serve/...`` of vLLM 0.33), through the ``openai``
client or HTTP against a real ``xllm serve``:

- custom message roles reach the chat template (``test_chat.py::test_custom_role``);
- ``--enable-force-include-usage`` (``test_enable_force_include_usage.py``);
- ``--return-tokens-as-token-ids`` server-wide (``test_return_tokens_as_ids.py``);
- ``GET /load`` with ``--enable-server-load-tracking`` (``instrumentator/test_basic.py::test_server_load``);
- ``GET /tokenizer_info`` with ``--enable-tokenizer-info-endpoint`` and ``/tokenize``'s ``token_strs``
  (``tokenize/test_tokenization.py``);
- ``--enable-per-request-metrics``: ``metrics`` on responses and the final usage chunk;
- ``--max-logprobs`` with ``top_logprobs`` / ``prompt_logprobs`` -1 (``test_chat_echo.py``);
- ``--logprobs-mode``: the default (raw) reports the model's own logprobs whatever the request's
  constraints (``test_logprob_token_ids.py``), ``processed_logprobs`` what the token is drawn from;
- a JSON schema's objects admit no keys it does not name unless it says so (vLLM's default backend),
  ``structured_outputs.disable_additional_properties: false`` restoring JSON Schema's own reading.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from xservice.commands.common import config_overrides

OPTIONS = {
    "enable_force_include_usage": True,
    "return_tokens_as_token_ids": True,
    "enable_server_load_tracking": True,
    "enable_tokenizer_info_endpoint": True,
    "enable_per_request_metrics": True,
}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def on(launch_server: Any, model_dir: Path) -> Iterator[Any]:
    """A server with every option on and no cap on logprobs."""
    engine = {"model": {"max_logprobs": -1, "logprobs_mode": "processed_logprobs"}}
    handle = launch_server(model_dir, OPTIONS, engine=engine)
    yield handle
    handle.stop()


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_flags_are_vllms(tmp_path: Path) -> None:
    from xservice.cli import build_parser

    flags = ["--enable-force-include-usage", "--return-tokens-as-token-ids", "--enable-server-load-tracking"]
    flags += ["--enable-tokenizer-info-endpoint", "--enable-per-request-metrics", "--max-logprobs", "-1"]
    got = config_overrides(build_parser().parse_args(["serve", *flags]))
    assert got["service"] == OPTIONS and got["model"] == {"max_logprobs": -1}


def test_custom_role(server: Any) -> None:
    client = _client(server)
    kw = dict(model=server.model_name, temperature=0, seed=0, max_tokens=5)
    resp1 = client.chat.completions.create(
        messages=[{"role": "my-custom-role", "content": "what is 1+1?"}], **kw
    )
    resp2 = client.chat.completions.create(
        messages=[{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}], **kw
    )
    assert resp1.choices[0].message.content == resp2.choices[0].message.content


def test_force_include_usage(on: Any) -> None:
    stream = _client(on).chat.completions.create(
        model=on.model_name,
        messages=MESSAGES,
        max_completion_tokens=10,
        extra_body=dict(min_tokens=10),
        temperature=0.0,
        stream=True,
    )
    last_completion_tokens, chunks = 0, 0
    for chunk in stream:
        chunks += 1
        assert chunk.usage.prompt_tokens >= 0
        assert (
            last_completion_tokens == 0
            or chunk.usage.completion_tokens > last_completion_tokens
            or (not chunk.choices and chunk.usage.completion_tokens == last_completion_tokens)
        )
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        last_completion_tokens = chunk.usage.completion_tokens
    assert chunks > 2 and last_completion_tokens == 10


@pytest.mark.parametrize("flag", [True, False])
def test_return_tokens_as_token_ids(server: Any, on: Any, flag: bool) -> None:
    target = on if flag else server
    extra = {} if flag else {"return_tokens_as_token_ids": True}
    completion = _client(target).completions.create(
        model=target.model_name,
        prompt="Say 'Hello, world! 🎉'",
        echo=True,
        temperature=0,
        max_tokens=10,
        logprobs=1,
        extra_body=extra,
    )
    tokens = completion.choices[0].logprobs.tokens
    assert tokens and all(t.startswith("token_id:") for t in tokens)
    for top in completion.choices[0].logprobs.top_logprobs[1:]:
        assert all(t.startswith("token_id:") for t in top)
    if flag:  # a request may still ask for text
        plain = _client(on).completions.create(
            model=on.model_name,
            prompt="Hi",
            max_tokens=3,
            logprobs=1,
            extra_body={"return_tokens_as_token_ids": False},
        )
        assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


def test_server_load(on: Any, server: Any) -> None:
    with on.client() as http:
        assert http.get("/load").json() == {"server_load": 0}
        done, status = threading.Event(), []

        def long_request() -> None:
            with on.client() as other:
                body = {
                    "prompt": "Give me a long story",
                    "max_tokens": 240,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                status.append(other.post("/v1/completions", json=body).status_code)
            done.set()

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 30
        seen = 0
        while time.monotonic() < deadline and not done.is_set():
            seen = max(seen, http.get("/load").json()["server_load"])
            if seen:
                break
            time.sleep(0.01)
        thread.join()
        assert seen == 1 and status == [200]
        assert http.get("/load").json() == {"server_load": 0}
    with server.client() as http:  # off: a 404 naming the option
        resp = http.get("/load")
        assert resp.status_code == 404 and "--enable-server-load-tracking" in resp.json()["error"]["message"]


def test_tokenizer_info(on: Any, server: Any, tokenizer: Any) -> None:
    with on.client() as http:
        info = http.get("/tokenizer_info").json()
        assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
        field_types = {
            "add_bos_token": bool,
            "clean_up_tokenization_spaces": bool,
            "bos_token": str,
            "eos_token": str,
            "pad_token": str,
            "chat_template": str,
            "errors": str,
            "model_max_length": int,
            "added_tokens_decoder": dict,
        }
        for name, kind in field_types.items():
            if info.get(name) is not None:
                assert isinstance(info[name], kind), name
        assert info["chat_template"] == tokenizer.chat_template
        assert not {"vocab_file", "merges_file"} & set(info)
        size = http.post("/tokenize", json={"prompt": "Hello world!"}).json()["max_model_len"]
        if info.get("model_max_length"):
            assert info["model_max_length"] >= size
    with server.client() as http:
        resp = http.get("/tokenizer_info")
        assert (
            resp.status_code == 404 and "--enable-tokenizer-info-endpoint" in resp.json()["error"]["message"]
        )


def test_tokenize_with_return_token_strs(http: httpx.Client, tokenizer: Any) -> None:
    prompt = "This is a token_strs test prompt! vllm1"
    result = http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
    assert result["tokens"] == tokens and result["count"] == len(tokens)
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(tokens)
    assert http.post("/tokenize", json={"prompt": prompt}).json()["token_strs"] is None


def _check_metrics(metrics: Any, num_tokens: int) -> None:
    m = metrics if isinstance(metrics, dict) else metrics.model_dump()
    assert set(m) >= {
        "time_to_first_token_ms",
        "generation_time_ms",
        "queue_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
    }
    assert all(m[k] is not None and m[k] >= 0 for k in m if k != "speculative_decoding"), m
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / (num_tokens - 1), rel=1e-6)
    assert m["tokens_per_second"] > 0


def test_per_request_metrics(on: Any, http: httpx.Client) -> None:
    with on.client() as client:
        body = {"messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        resp = client.post("/v1/chat/completions", json=body).json()
        _check_metrics(resp["metrics"], 6)
        resp = client.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "ignore_eos": True}
        ).json()
        _check_metrics(resp["metrics"], 5)
        two = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "n": 2}).json()
        assert "metrics" not in two  # n > 1: no single timing
        one = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()["metrics"]
        assert "mean_itl_ms" not in one and one["tokens_per_second"] > 0  # one token: no ITL (vLLM omits it)
    stream = _client(on).chat.completions.create(
        model=on.model_name, messages=MESSAGES, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    final = chunks[-1].model_dump()
    assert not final["choices"] and final["usage"]["completion_tokens"] == 4
    _check_metrics(final["metrics"], 4)
    assert all("metrics" not in c.model_extra or c.model_extra["metrics"] is None for c in chunks[:-1])
    off = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert "metrics" not in off


def test_whole_vocabulary_logprobs(on: Any, http: httpx.Client, tokenizer: Any) -> None:
    client = _client(on)
    completion = client.chat.completions.create(
        model=on.model_name,
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"top_logprobs": -1, "logprobs": True},
    )
    content = completion.choices[0].logprobs.content
    assert content and len(content[0].top_logprobs) == tokenizer.vocab_size
    echoed = client.chat.completions.create(
        model=on.model_name, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": -1}
    )
    assert echoed.prompt_logprobs and len(echoed.prompt_logprobs) > 0
    # the default limit (20): -1 is more than it allows, a 400 naming the field and the option
    resp = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": -1},
    )
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "top_logprobs" and "--max-logprobs" in err["message"]


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def test_logprobs_are_the_models_own_by_default(server: Any, on: Any) -> None:
    """raw_logprobs (the default): with ``allowed_token_ids: [42]`` the chosen token's logprob and the
    asked ids' are the model's own (what an unconstrained request reports), all finite;
    processed_logprobs: the constrained distribution (the only allowed id has logprob 0)."""
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "temperature": 0}
    body |= {"logprobs": True, "return_tokens_as_token_ids": True}
    ids = [100, 1000]
    with server.client() as http:
        free = http.post("/v1/chat/completions", json={**body, "logprob_token_ids": [42, *ids]}).json()
        want = {
            _token_id(t["token"]): t["logprob"]
            for t in free["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        }
        got = http.post(
            "/v1/chat/completions", json={**body, "logprob_token_ids": ids, "allowed_token_ids": [42]}
        ).json()
    entry = got["choices"][0]["logprobs"]["content"][0]
    assert _token_id(entry["token"]) == 42 and entry["logprob"] == pytest.approx(want[42], abs=1e-4)
    tops = {_token_id(t["token"]): t["logprob"] for t in entry["top_logprobs"]}
    assert set(tops) == {42, *ids}
    assert all(tops[i] == pytest.approx(want[i], abs=1e-4) and tops[i] > -1e4 for i in ids)
    with on.client() as http:
        got = http.post(
            "/v1/chat/completions", json={**body, "logprob_token_ids": ids, "allowed_token_ids": [42]}
        )
    entry = got.json()["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == pytest.approx(0.0, abs=1e-6)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_schema_objects_are_closed_by_default(http: httpx.Client) -> None:
    import json

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    body = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 3,
        "n": 4,
        "response_format": fmt,
    }
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert set(json.loads(choice["message"]["content"])) == {"a"}


def test_additional_properties_default_and_override() -> None:
    """The grammar of a schema without additionalProperties closes its objects unless the request (or the
    server's structured_outputs.disable_additional_properties) says false."""
    from xengine.api.grammar import grammar_spec
    from xservice.protocol import ChatCompletionRequest
    from xservice.serving.structured import structured_outputs

    def source(body: dict[str, Any], closed: bool = True) -> dict[str, Any]:
        import json

        req = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
        req._closed_objects = closed
        return json.loads(grammar_spec(structured_outputs(req)).source)

    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    assert source(fmt)["additionalProperties"] is False
    assert "additionalProperties" not in source(fmt, closed=False)
    so = {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": False}}
    assert "additionalProperties" not in source(so)
    assert source({"structured_outputs": {"json": {**SCHEMA, "additionalProperties": True}}})[
        "additionalProperties"
    ]
