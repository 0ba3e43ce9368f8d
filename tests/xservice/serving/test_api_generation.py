"""Completions and chat through the real server with the ``openai`` client, checked against the offline ``LLM``."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xengine.api.messages import SamplingParams

PROMPTS = ["Hello world", "The quick brown fox jumps over", "Once upon a time there was"]
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(model_dir: Path, server) -> dict[str, Any]:
    """Greedy outputs of the offline ``LLM`` with the server's engine settings, one prompt at a time."""
    from xengine.llm import LLM

    s = server.config
    llm = LLM(
        model=str(model_dir),
        max_model_len=s["model"]["max_model_len"],
        seed=s["model"]["seed"],
        block_size=s["cache"]["block_size"],
        num_blocks=s["cache"]["num_blocks"],
        max_num_seqs=s["scheduler"]["max_num_seqs"],
        max_num_batched_tokens=s["scheduler"]["max_num_batched_tokens"],
        device="cpu",
        num_threads=1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out: dict[str, Any] = {}
    for p in PROMPTS:
        out[p] = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
    for i, conv in enumerate(CONVERSATIONS):
        out[f"chat{i}"] = llm.chat(conv, params, use_tqdm=False)[0].outputs[0]
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client: openai.OpenAI, server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model_name]


def test_completions_match_offline_llm(client: openai.OpenAI, server, expected, tokenizer) -> None:
    for prompt in PROMPTS:
        out = client.completions.create(
            model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        ref = expected[prompt]
        assert (
            out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == server.model_name
        )
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_token_id_prompts_and_batch(client: openai.OpenAI, server, expected, tokenizer) -> None:
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    single = client.completions.create(
        model=server.model_name, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert single.choices[0].text == expected[PROMPTS[0]].text
    # Batch of prompts with n=2: choices are indexed prompt-major.
    batch = client.completions.create(
        model=server.model_name, prompt=ids, n=2, max_tokens=MAX_TOKENS, temperature=0
    )
    by_index = sorted(batch.choices, key=lambda c: c.index)
    assert [c.index for c in by_index] == [0, 1, 2, 3]
    want = [expected[PROMPTS[0]].text] * 2 + [expected[PROMPTS[1]].text] * 2
    assert [c.text for c in by_index] == want
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert batch.usage.completion_tokens == 2 * (
        len(expected[PROMPTS[0]].token_ids) + len(expected[PROMPTS[1]].token_ids)
    )


def test_completion_stream_equals_non_stream(client: openai.OpenAI, server, expected, tokenizer) -> None:
    prompt = PROMPTS[1]
    stream = client.completions.create(
        model=server.model_name,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(c.choices[0].text for c in chunks[:-1])
    assert text == expected[prompt].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == expected[prompt].finish_reason
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert chunks[-1].usage.completion_tokens == len(expected[prompt].token_ids)


def test_echo(client: openai.OpenAI, server, expected) -> None:
    prompt = PROMPTS[0]
    out = client.completions.create(
        model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True
    )
    assert out.choices[0].text == prompt + expected[prompt].text


def _chat_prompt_len(http: httpx.Client, messages: list[dict[str, str]]) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


def test_chat_matches_offline_llm(client: openai.OpenAI, server, expected, http) -> None:
    for i, conv in enumerate(CONVERSATIONS):
        out = client.chat.completions.create(
            model=server.model_name, messages=conv, max_tokens=MAX_TOKENS, temperature=0
        )
        ref = expected[f"chat{i}"]
        assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].message.content == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.prompt_tokens == _chat_prompt_len(http, conv)
        assert out.usage.completion_tokens == len(ref.token_ids)


def test_chat_stream_and_text_parts(client: openai.OpenAI, server, expected) -> None:
    conv = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story about a cat."}]}]
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=conv,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["chat0"].text
    assert chunks[-1].usage.completion_tokens == len(expected["chat0"].token_ids)


def test_chat_default_max_tokens_is_rest_of_context(client: openai.OpenAI, server, http) -> None:
    conv = CONVERSATIONS[1]
    out = client.chat.completions.create(
        model=server.model_name, messages=conv, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == server.config["model"]["max_model_len"]
    assert out.usage.prompt_tokens == _chat_prompt_len(http, conv)


def test_n_and_seed(client: openai.OpenAI, server) -> None:
    kw = dict(model=server.model_name, messages=CONVERSATIONS[0], max_tokens=8, temperature=1.0, n=2, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 16


def test_completion_logprobs(client: openai.OpenAI, server, expected) -> None:
    prompt = PROMPTS[2]
    out = client.completions.create(
        model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    n = len(expected[prompt].token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 1 <= len(tops) <= 4
        assert max(tops.values()) == pytest.approx(logprob, abs=1e-4)  # greedy picks the most likely token
        assert tops[token] == pytest.approx(logprob, abs=1e-4)
    if not any("\ufffd" in t for t in lp.tokens):
        assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs(client: openai.OpenAI, server, expected) -> None:
    out = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATIONS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == len(expected["chat0"].token_ids)
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert item.top_logprobs[1].logprob <= item.logprob + 1e-6
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def _ascii_window(text: str) -> str:
    """A short stop string from the middle of ``text`` made of ASCII letters, not at its start."""
    for width in (3, 2):
        for start in range(max(1, len(text) // 3), len(text) - width + 1):
            piece = text[start : start + width]
            if piece.isascii() and piece.isalpha() and text.find(piece) > 0:
                return piece
    pytest.skip(f"no usable stop string in {text!r}")


def test_stop_strings(client: openai.OpenAI, server, expected) -> None:
    prompt = PROMPTS[0]
    full = expected[prompt].text
    stop = _ascii_window(full)
    want = full[: full.find(stop)]
    kw = dict(model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    out = client.completions.create(stop=[stop, "zzzz-never"], **kw)
    assert out.choices[0].text == want
    assert stop not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == want
    kept = client.completions.create(stop=stop, extra_body={"include_stop_str_in_output": True}, **kw)
    assert kept.choices[0].text == want + stop


def test_chat_stop_string_stream(client: openai.OpenAI, server, expected) -> None:
    full = expected["chat0"].text
    stop = _ascii_window(full)
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATIONS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=stop,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full[: full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_priority_offline_and_extra_sampling_fields(http: httpx.Client, server) -> None:
    body = {
        "model": server.model_name,
        "prompt": PROMPTS[0],
        "max_tokens": 6,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.01,
        "seed": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "user": "test-user",
        "priority": "offline",
    }
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 6


def test_tokenize_detokenize(http: httpx.Client, tokenizer) -> None:
    text = "Hello world, tokens!"
    out = http.post("/tokenize", json={"prompt": text}).json()
    assert out["tokens"] == tokenizer.encode(text)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    back = http.post("/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(out["tokens"], skip_special_tokens=False)
    chat = http.post("/tokenize", json={"messages": CONVERSATIONS[0]}).json()
    text = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_health_and_metrics(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/health/ready").status_code == 200
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    stats = http.get("/v1/admin/stats").json()
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in (
        "xllm_time_to_first_token_seconds",
        "xllm_time_per_output_token_seconds",
        "xllm_inter_token_latency_seconds",
        "xllm_e2e_request_latency_seconds",
    ):
        count = [s.value for s in families[name].samples if s.name == name + "_count"]
        assert count and count[0] >= 1, name
    values = {s.name: s for f in families.values() for s in f.samples}
    assert values["xllm_kv_free_blocks"].value == stats["num_free_blocks"]
    assert values["xllm_num_requests_running"].value == 0
    assert values["xllm_prompt_tokens_total"].value > 0
    assert values["xllm_generation_tokens_total"].value >= 3
    for name in (
        "xllm_kv_cache_usage_ratio",
        "xllm_prefix_cache_hit_rate",
        "xllm_num_requests_waiting",
        "xllm_num_preemptions",
    ):
        assert name in values
    success = [s for s in families["xllm_request_success"].samples if s.name == "xllm_request_success_total"]
    assert any(s.labels["finished_reason"] == "length" and s.value >= 1 for s in success)


def test_service_never_imports_torch() -> None:
    root = Path(__file__).resolve().parents[3]
    code = "import sys, xservice.http.app; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code],
        capture_output=True,
        text=True,
        cwd=root,
        check=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert json.loads(out.stdout) == []


def test_cached_tokens_reported(client: openai.OpenAI, server, tokenizer) -> None:
    prompt = "Shared prefix for the cache test. " * 6  # several full 16-token blocks
    kw = dict(model=server.model_name, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == len(tokenizer.encode(prompt))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0


def test_chat_stream_n2(client: openai.OpenAI, server) -> None:
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATIONS[1],
        max_tokens=5,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finish: dict[int, str] = {}
    roles: set[int] = set()
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role == "assistant":
                roles.add(c.index)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0, 1} and finish == {0: "length", 1: "length"}


def test_echo_token_ids(client: openai.OpenAI, server, expected, tokenizer) -> None:
    ids = tokenizer.encode(PROMPTS[0])
    out = client.completions.create(
        model=server.model_name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, echo=True
    )
    assert out.choices[0].text == tokenizer.decode(ids, skip_special_tokens=False) + expected[PROMPTS[0]].text
