"""vLLM's request extensions through the real server: ``return_token_ids``, ``return_tokens_as_token_ids``,
``stream_options.continuous_usage_stats``, ``truncate_prompt_tokens`` (+ ``truncation_side``),
``add_special_tokens`` and ``spaces_between_special_tokens``; with the ``openai`` client and httpx.

Greedy tokens of a truncated prompt are checked against HF ``transformers`` on the same weights.
"""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.xengine.conftest import HFOracle

PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _extra(**fields: Any) -> dict[str, Any]:
    return {**GREEDY, "extra_body": {**GREEDY["extra_body"], **fields}}


def _chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


# --- return_token_ids -------------------------------------------------------------------------------


def test_completion_return_token_ids(client: openai.OpenAI, server, tokenizer) -> None:
    out = client.completions.create(model=server.model_name, prompt=PROMPT, **_extra(return_token_ids=True))
    choice = out.choices[0]
    assert choice.prompt_token_ids == tokenizer.encode(PROMPT)
    assert len(choice.token_ids) == out.usage.completion_tokens == 8
    assert tokenizer.decode(choice.token_ids) == choice.text
    # not asked: the keys are there (as in vLLM) and null
    plain = client.completions.create(model=server.model_name, prompt=PROMPT, **GREEDY).model_dump()
    assert plain["choices"][0]["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None

    stream = client.completions.create(
        model=server.model_name, prompt=PROMPT, stream=True, **_extra(return_token_ids=True)
    )
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice.prompt_token_ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice.token_ids
    plain_chunks = [
        c.model_dump()
        for c in client.completions.create(model=server.model_name, prompt=PROMPT, stream=True, **GREEDY)
    ]
    assert all("token_ids" not in c["choices"][0] for c in plain_chunks)


def test_chat_return_token_ids(client: openai.OpenAI, server, tokenizer) -> None:
    out = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, **_extra(return_token_ids=True)
    )
    assert out.prompt_token_ids == _chat_prompt_ids(tokenizer, MESSAGES)
    assert tokenizer.decode(out.choices[0].token_ids) == out.choices[0].message.content
    plain = client.chat.completions.create(model=server.model_name, messages=MESSAGES, **GREEDY).model_dump()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None

    stream = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, stream=True, **_extra(return_token_ids=True)
    )
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["prompt_token_ids"] == out.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    assert streamed == out.choices[0].token_ids


# --- return_tokens_as_token_ids ---------------------------------------------------------------------


def test_completion_tokens_as_token_ids(client: openai.OpenAI, server, tokenizer) -> None:
    fields = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    out = client.completions.create(model=server.model_name, prompt=PROMPT, logprobs=2, **_extra(**fields))
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in choice.token_ids]
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and all(k.startswith("token_id:") for k in top)
    # text offsets still index the output text
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in choice.token_ids]
    assert lp.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]

    stream = client.completions.create(
        model=server.model_name, prompt=PROMPT, logprobs=2, stream=True, **_extra(**fields)
    )
    streamed = [t for c in stream for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert streamed == lp.tokens


def test_chat_tokens_as_token_ids(client: openai.OpenAI, server, tokenizer) -> None:
    fields = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    out = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, logprobs=True, top_logprobs=2, **_extra(**fields)
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in out.choices[0].token_ids]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    ids = [int(c.token.removeprefix("token_id:")) for c in content]
    assert tokenizer.decode(ids) == out.choices[0].message.content


# --- continuous_usage_stats -------------------------------------------------------------------------


def test_completion_continuous_usage(client: openai.OpenAI, server) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=server.model_name, prompt=PROMPT, stream=True, stream_options=options, **GREEDY
        )
    )
    *content, final = chunks
    assert final.choices == [] and final.usage.completion_tokens == 8
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 8 and counts[0] >= 1
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in content)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in content)
    # as in vLLM, it modifies include_usage: without it no chunk carries usage
    alone = {"include_usage": False, "continuous_usage_stats": True}
    stream = client.completions.create(
        model=server.model_name, prompt=PROMPT, stream=True, stream_options=alone, **GREEDY
    )
    assert all(c.usage is None for c in stream)


def test_chat_continuous_usage(client: openai.OpenAI, server) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, stream=True, stream_options=options, n=2, **GREEDY
    )
    *content, final = list(stream)
    assert final.choices == [] and final.usage.completion_tokens == 16
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in content:
        per_choice[c.choices[0].index].append(c.usage.completion_tokens)
    for counts in per_choice.values():  # the role chunk (0 tokens), then each choice's own count
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 8


def test_stream_options_need_stream(http: httpx.Client, server) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        resp = http.post(path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "stream_options"


# --- truncate_prompt_tokens -------------------------------------------------------------------------


def _hf_greedy(model_dir: Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):  # greedy, not stopping at EOS (the server runs with ignore_eos)
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: openai.OpenAI, server, tokenizer, model_dir: Path
) -> None:
    long_ids = tokenizer.encode(" ".join(["the cat sat on the mat"] * 60))
    max_len = server.config["model"]["max_model_len"]
    assert len(long_ids) > max_len  # too long without truncation
    out = client.completions.create(
        model=server.model_name, prompt=long_ids, **_extra(truncate_prompt_tokens=20, return_token_ids=True)
    )
    assert out.usage.prompt_tokens == 20 and out.choices[0].prompt_token_ids == long_ids[-20:]
    assert out.choices[0].token_ids == _hf_greedy(model_dir, long_ids[-20:], 8)

    right = client.completions.create(
        model=server.model_name,
        prompt=long_ids,
        **_extra(truncate_prompt_tokens=20, truncation_side="right", return_token_ids=True),
    )
    assert right.choices[0].prompt_token_ids == long_ids[:20]
    # -1: as much as the context holds, leaving one token to generate
    whole = client.completions.create(
        model=server.model_name,
        prompt=long_ids,
        temperature=0,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert whole.usage.prompt_tokens == max_len - 1
    # a text prompt past the (pre-tokenization) character bound is fine when it is truncated
    text = "x" * (max_len * 64)
    long_text = client.completions.create(
        model=server.model_name, prompt=text, **_extra(truncate_prompt_tokens=16)
    )
    assert long_text.usage.prompt_tokens == 16


def test_chat_truncate_prompt_tokens(client: openai.OpenAI, server, tokenizer) -> None:
    out = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, **_extra(truncate_prompt_tokens=5, return_token_ids=True)
    )
    assert out.prompt_token_ids == _chat_prompt_ids(tokenizer, MESSAGES)[-5:]
    assert out.usage.prompt_tokens == 5


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
        ({"truncation_side": "left"}, "truncation_side"),
        ({"truncate_prompt_tokens": 5, "truncation_side": "middle"}, "truncation_side"),
    ],
)
def test_bad_truncation_is_400(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        resp = http.post(path, json={**body, "max_tokens": 2, **fields})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


# --- add_special_tokens -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bos_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[Any]:
    """A server whose tokenizer adds a BOS token (``add_bos_token``), so the field has something to do."""
    bos_dir = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(model_dir, bos_dir)
    cfg_path = bos_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=True, bos_token="<|endoftext|>")
    cfg_path.write_text(json.dumps(cfg))
    handle = launch_server(bos_dir)
    yield handle
    handle.stop()


def test_add_special_tokens(bos_server, tokenizer) -> None:
    bos = tokenizer.token_to_id("<|endoftext|>")
    plain = tokenizer.encode(PROMPT, add_special_tokens=False)
    with bos_server.client() as http:

        def prompt_ids(path: str, body: dict[str, Any]) -> list[int]:
            body = {**body, "max_tokens": 1, "return_token_ids": True}
            resp = http.post(path, json=body)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            return (
                out["prompt_token_ids"]
                if "prompt_token_ids" in out
                else out["choices"][0]["prompt_token_ids"]
            )

        # completions: the tokenizer's special tokens by default (vLLM), not with false
        assert prompt_ids("/v1/completions", {"prompt": PROMPT}) == [bos, *plain]
        assert prompt_ids("/v1/completions", {"prompt": PROMPT, "add_special_tokens": False}) == plain
        # chat: only the template's by default (vLLM), the tokenizer's on top with true
        chat = _chat_prompt_ids(tokenizer, MESSAGES)
        assert prompt_ids("/v1/chat/completions", {"messages": MESSAGES}) == chat
        with_bos = prompt_ids("/v1/chat/completions", {"messages": MESSAGES, "add_special_tokens": True})
        assert with_bos == [bos, *chat]


# --- spaces_between_special_tokens ------------------------------------------------------------------


def test_spaces_between_special_tokens_accepted(client: openai.OpenAI, server, tokenizer) -> None:
    """This byte-level tokenizer puts no spaces between special tokens, so the text is the same either
    way (the detokenizer tests cover a WordPiece tokenizer, where it differs)."""
    prompt = tokenizer.encode(PROMPT)
    outs = [
        client.completions.create(
            model=server.model_name,
            prompt=prompt,
            **_extra(skip_special_tokens=False, spaces_between_special_tokens=flag, return_token_ids=True),
        ).choices[0]
        for flag in (True, False)
    ]
    assert outs[0].text == outs[1].text == tokenizer.decode(outs[0].token_ids, skip_special_tokens=False)


# --- POST /v1/chat/completions/batch (vLLM's batched chat completions) ------------------------------

BATCH = [MESSAGES, [{"role": "user", "content": "Name three colours."}]]


def test_chat_batch_answers_each_conversation(
    http: httpx.Client, client: openai.OpenAI, server, tokenizer
) -> None:
    fields = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    body = {"model": server.model_name, "messages": BATCH, "return_token_ids": True, **fields}
    resp = http.post("/v1/chat/completions/batch", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["object"] == "chat.completion" and [c["index"] for c in data["choices"]] == [0, 1]
    for conversation, choice in zip(BATCH, data["choices"]):  # what the single-conversation route answers
        alone = http.post("/v1/chat/completions", json={**body, "messages": conversation}).json()
        single = alone["choices"][0]
        assert choice["message"] == single["message"] and choice["token_ids"] == single["token_ids"]
        assert len(choice["token_ids"]) == 8
        got, want = choice["logprobs"]["content"], single["logprobs"]["content"]
        assert [e["token"] for e in got] == [e["token"] for e in want]
        # batch composition moves float32 sums by ~1e-6
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
        assert [len(e["top_logprobs"]) for e in got] == [2] * 8
    prompt_tokens = sum(len(_chat_prompt_ids(tokenizer, c)) for c in BATCH)
    assert data["usage"]["prompt_tokens"] == prompt_tokens and data["usage"]["completion_tokens"] == 16
    assert data["prompt_token_ids"] is None  # one prompt per conversation (as in vLLM)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [MESSAGES, []]}, "messages"),
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": [MESSAGES, [{"role": 5, "content": "x"}]]}, "messages.1.0"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"logprob_token_ids": [1, 2]}, "logprob_token_ids"),  # without logprobs: a 400, as alone
    ],
)
def test_chat_batch_bad_body_is_400(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/chat/completions/batch", json={"messages": BATCH, "max_tokens": 2, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param), resp.json()
    if param == "logprob_token_ids":
        single = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **fields})
        assert single.status_code == 400 and single.json()["error"]["param"] == param


# --- POST /invocations (vLLM's single route for SageMaker-style hosting) ----------------------------


@pytest.mark.parametrize(
    "route,body",
    [
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "temperature": 0, "max_tokens": 6, "ignore_eos": True},
        ),
        ("/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 6, "ignore_eos": True}),
        ("/v1/embeddings", {"input": PROMPT}),
    ],
)
def test_invocations_answers_as_the_api_route(http: httpx.Client, route: str, body: dict[str, Any]) -> None:
    direct, via = http.post(route, json=body), http.post("/invocations", json=body)
    assert direct.status_code == via.status_code == 200, via.text
    a, b = direct.json(), via.json()
    for key in ("id", "created"):
        a.pop(key, None), b.pop(key, None)
    for out in (a, b):  # the second request hits the prefix cache
        out.get("usage", {}).pop("prompt_tokens_details", None)
    if route == "/v1/embeddings":
        assert b["data"][0]["embedding"] == pytest.approx(a["data"][0]["embedding"], abs=1e-5)
        a["data"] = b["data"] = None
    assert a == b


@pytest.mark.parametrize(
    "body,param",
    [
        ({"text": "hi"}, "text"),
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"messages": 3}, "messages"),
    ],
)
def test_invocations_bad_body_is_400(http: httpx.Client, body: dict[str, Any], param: str | None) -> None:
    resp = http.post("/invocations", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


# --- logprob_token_ids ------------------------------------------------------------------------------

LABEL_IDS = [3, 7, 100]


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Iterator[HFOracle]:
    oracle = HFOracle(model_dir)
    yield oracle
    del oracle
    gc.collect()


def _hf_rows(hf: HFOracle, prompt_ids: list[int], token_ids: list[int]):
    """Row i: HF's full-vocabulary logprobs of output token i."""
    full = hf.logits(prompt_ids + token_ids).log_softmax(-1)
    return full[len(prompt_ids) - 1 : -1]


def test_completion_logprob_token_ids_match_hf(client: openai.OpenAI, server, hf: HFOracle) -> None:
    fields = {"logprob_token_ids": LABEL_IDS, "return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(model=server.model_name, prompt=PROMPT, logprobs=5, **_extra(**fields))
    choice = out.choices[0]
    rows = _hf_rows(hf, choice.prompt_token_ids, choice.token_ids)
    assert len(choice.logprobs.top_logprobs) == 8
    for token_id, top, row in zip(choice.token_ids, choice.logprobs.top_logprobs, rows):
        # exactly the chosen token and the asked ids (not the top 5), each at its HF logprob
        assert set(top) == {f"token_id:{t}" for t in [token_id, *LABEL_IDS]}
        for t in {token_id, *LABEL_IDS}:
            assert top[f"token_id:{t}"] == pytest.approx(row[t].item(), abs=1e-4)
    stream = client.completions.create(
        model=server.model_name, prompt=PROMPT, logprobs=5, stream=True, **_extra(**fields)
    )
    tops = [
        t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs
    ]
    assert [set(t) for t in tops] == [set(t) for t in choice.logprobs.top_logprobs]


def test_chat_logprob_token_ids_match_hf(client: openai.OpenAI, server, hf: HFOracle) -> None:
    fields = {"logprob_token_ids": LABEL_IDS, "return_tokens_as_token_ids": True, "return_token_ids": True}
    # top_logprobs sets no count with logprob_token_ids (as in vLLM): 1 here, 4 ids come back
    out = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, logprobs=True, top_logprobs=1, **_extra(**fields)
    )
    choice = out.choices[0]
    rows = _hf_rows(hf, out.prompt_token_ids, choice.token_ids)
    for token_id, entry, row in zip(choice.token_ids, choice.logprobs.content, rows):
        ids = [int(e.token.removeprefix("token_id:")) for e in entry.top_logprobs]
        assert ids == list(dict.fromkeys([token_id, *LABEL_IDS]))  # the chosen token first, each id once
        for t, e in zip(ids, entry.top_logprobs):
            assert e.logprob == pytest.approx(row[t].item(), abs=1e-4)
    stream = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, logprobs=True, stream=True, **_extra(**fields)
    )
    content = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [[e.token for e in x.top_logprobs] for x in content] == [
        [e.token for e in x.top_logprobs] for x in choice.logprobs.content
    ]


@pytest.mark.parametrize(
    "route,fields",
    [
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [10**7]}),  # not in the vocabulary
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [-1]}),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": []}),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [1] * 129}),
        ("/v1/completions", {"logprob_token_ids": [1]}),  # needs logprobs
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [1], "echo": True, "max_tokens": 0}),
        ("/v1/completions", {"logprob_token_ids": [1], "use_beam_search": True}),
        ("/v1/chat/completions", {"logprob_token_ids": [1]}),  # needs logprobs: true
        ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": [10**7]}),
        ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": "1"}),
    ],
)
def test_bad_logprob_token_ids_is_400(http: httpx.Client, route: str, fields: dict[str, Any]) -> None:
    body = {"max_tokens": 2, **fields}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES})
    resp = http.post(route, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "logprob_token_ids", resp.json()
