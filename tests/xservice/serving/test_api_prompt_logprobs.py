"""``echo`` + ``logprobs`` and ``prompt_logprobs`` through real servers, against HF on the same weights:
the shared server (whole prefills) and one with 32-token chunked prefill and async scheduling on;
with and without the prompt already in the prefix cache; streamed and not; bad values are 400s."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.xengine.conftest import HFOracle, random_prompts
from tests.xservice.conftest import MAIN_SERVICE, ServerHandle, start_server

TOL = 1e-4
CHUNKED = {"scheduler": {"max_num_batched_tokens": 32}, "execution": {"async_scheduling": "on"}}


@pytest.fixture(scope="module")
def chunked_server(model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(model_dir, MAIN_SERVICE, engine=CHUNKED)
    yield handle
    handle.stop()


@pytest.fixture(scope="module", params=["whole", "chunked+async"])
def srv(request: pytest.FixtureRequest) -> ServerHandle:
    return request.getfixturevalue("server" if request.param == "whole" else "chunked_server")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Iterator[HFOracle]:
    oracle = HFOracle(model_dir)
    yield oracle
    del oracle
    gc.collect()


def client_of(srv: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def hf_sequence_logprobs(hf: HFOracle, ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row i is HF's distribution of token i + 1 given tokens <= i."""
    return hf.logits(ids)[:-1].log_softmax(-1)


def post(srv: ServerHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    with srv.client() as http:
        return http.post(path, json={"model": srv.model_name, **body})


def check_vllm_prompt_logprobs(field: list[Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: None, then per token {id: {logprob, rank, decoded_token}} for it and the top k."""
    assert len(field) == len(ids) and field[0] is None
    for i in range(1, len(ids)):
        entry = {int(t): v for t, v in field[i].items()}
        row = ref[i - 1]
        assert ids[i] in entry and len(entry) in (k, k + 1)
        for token_id, v in entry.items():
            assert v["logprob"] == pytest.approx(row[token_id].item(), abs=TOL)
            assert isinstance(v["decoded_token"], str)
        lp = row[ids[i]].item()
        rank = entry[ids[i]]["rank"]
        assert 1 + int((row > lp + TOL).sum()) <= rank <= 1 + int((row > lp - TOL).sum())
        top = sorted(v["logprob"] for v in entry.values())[-k:] if k else []
        assert top == pytest.approx(sorted(row.topk(k).values.tolist()), abs=TOL)


def test_echo_logprobs_match_hf(srv: ServerHandle, hf: HFOracle, tokenizer) -> None:
    """OpenAI's legacy shape over prompt + completion: null first, then HF's logprobs for every token
    (prompt tokens and sampled ones), top alternatives, offsets continuing over the whole text."""
    ids = random_prompts([70], seed=21)[0]
    out = client_of(srv).completions.create(
        model=srv.model_name,
        prompt=ids,
        max_tokens=3,
        echo=True,
        logprobs=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice, lp = out.choices[0], out.choices[0].logprobs
    full = ids + hf.greedy(ids, 3)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 73
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in full]
    assert choice.text == tokenizer.decode(full, skip_special_tokens=False)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(73)]
    ref = hf_sequence_logprobs(hf, full)
    ids_of_text: dict[str, list[int]] = {}  # byte-level BPE: several ids may decode to the same text
    for t in range(ref.shape[1]):
        ids_of_text.setdefault(tokenizer.decode([t], skip_special_tokens=False), []).append(t)
    for i in range(1, 73):
        row, tops = ref[i - 1], lp.top_logprobs[i]
        assert lp.token_logprobs[i] == pytest.approx(row[full[i]].item(), abs=TOL), f"position {i}"
        assert tops[lp.tokens[i]] == lp.token_logprobs[i]  # the token itself comes first
        top2 = {tokenizer.decode([t], skip_special_tokens=False) for t in row.topk(2).indices.tolist()}
        assert top2 <= set(tops), f"position {i}"
        for text, value in tops.items():  # each value is HF's for a token of that text
            assert min(abs(row[t].item() - value) for t in ids_of_text[text]) < TOL, (i, text)
    assert out.usage.prompt_tokens == 70 and out.usage.completion_tokens == 3


def test_echo_stream_equals_non_stream(srv: ServerHandle) -> None:
    ids = random_prompts([50], seed=22)[0]
    body = dict(model=srv.model_name, prompt=ids, max_tokens=4, echo=True, logprobs=1, temperature=0)
    client = client_of(srv)
    whole = client.completions.create(**body).choices[0]
    text, tokens, token_lps, offsets = "", [], [], []
    for chunk in client.completions.create(**body, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert token_lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)


def test_echo_scoring_only(srv: ServerHandle, hf: HFOracle, tokenizer) -> None:
    """``max_tokens: 0`` with ``echo`` (lm-evaluation-harness, vLLM): the prompt scored, nothing
    generated; ``n > 1`` choices all carry it."""
    ids = random_prompts([40], seed=23)[0]
    out = client_of(srv).completions.create(
        model=srv.model_name, prompt=ids, max_tokens=0, echo=True, logprobs=0, n=2
    )
    ref = hf_sequence_logprobs(hf, ids)
    want = [None] + [ref[i - 1, ids[i]].item() for i in range(1, 40)]
    for choice in out.choices:
        assert choice.finish_reason == "length"
        assert choice.text == tokenizer.decode(ids, skip_special_tokens=False)
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(want[1:], abs=TOL)
    assert out.usage.completion_tokens == 0


def test_prompt_logprobs_with_and_without_a_prefix_hit(srv: ServerHandle, hf: HFOracle) -> None:
    """First with the prompt not cached, then with it in the prefix cache (a plain request shows the
    hit): a ``prompt_logprobs`` request recomputes it (cached_tokens 0, a cached block has no hidden
    states) and gets every position's logprobs both times."""
    ids = random_prompts([90], seed=24)[0]
    ref = hf_sequence_logprobs(hf, ids)

    def with_prompt_logprobs() -> None:
        resp = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        check_vllm_prompt_logprobs(body["choices"][0]["prompt_logprobs"], ids, ref, 2)

    with_prompt_logprobs()  # not cached yet
    plain = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 80  # 5 blocks, left by the first
    assert plain["choices"][0]["prompt_logprobs"] is None  # not asked: null, as in vLLM
    with_prompt_logprobs()  # cached now


def test_chat_prompt_logprobs(srv: ServerHandle, hf: HFOracle) -> None:
    messages = [{"role": "user", "content": "Tell me about the weather in a small town by the sea."}]
    ids = post(srv, "/tokenize", {"messages": messages}).json()["tokens"]
    resp = post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    check_vllm_prompt_logprobs(body["prompt_logprobs"], ids, hf_sequence_logprobs(hf, ids), 1)


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/v1/completions", {"prompt_logprobs": 21}),
        ("/v1/completions", {"prompt_logprobs": -1, "echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt_logprobs": "2"}),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"prompt_logprobs": 21}),
        ("/v1/chat/completions", {"prompt_logprobs": 0, "stream": True}),
    ],
)
def test_bad_prompt_logprobs_are_400s(server: ServerHandle, path: str, extra: dict[str, Any]) -> None:
    base = (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    resp = post(server, path, {**base, "max_tokens": 1, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt_logprobs"


def test_scoring_a_too_long_prompt_is_a_400(server: ServerHandle) -> None:
    resp = post(
        server, "/v1/completions", {"prompt": [7] * 257, "max_tokens": 0, "echo": True, "logprobs": 1}
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    resp = post(
        server, "/v1/completions", {"prompt": [7] * 256, "max_tokens": 0, "echo": True, "logprobs": 1}
    )
    assert resp.status_code == 200, resp.text  # a prompt that fills the context can be scored
    assert len(json.loads(resp.text)["choices"][0]["logprobs"]["tokens"]) == 256
