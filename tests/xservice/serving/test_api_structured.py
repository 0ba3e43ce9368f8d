"""Structured outputs and token-level constraints through a real ``xllm serve``, with real clients.

The OpenAI SDK's ``parse()`` and LangChain's ``with_structured_output`` get valid instances back;
``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` and ``guided_*`` work on
both endpoints, streamed, with ``n > 1`` and in batch jobs; invalid schemas, regexes, grammars and
logit biases are 400s naming the field; logit_bias, allowed_token_ids and bad_words act on the output.

The model is a tiny random checkpoint, so what it writes inside a grammar is noise: the schemas
bound every string, number and array and switch off free JSON whitespace (``disable_any_whitespace``)
so each generation ends well within ``max_tokens``; validation itself is never relaxed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "temp_c": {"type": "integer", "minimum": -50, "maximum": 50},
        "conditions": {"type": "array", "items": {"enum": ["rain", "sun", "wind"]}, "maxItems": 2},
        "alert": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    },
    "required": ["city", "temp_c", "conditions", "alert"],
    "additionalProperties": False,
}
FLAGS = {
    "type": "object",
    "properties": {
        "version": {"const": 2},
        "enabled": {"type": "boolean"},
        "level": {"enum": [1, 2, 3]},
        "code": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
    },
    "required": ["version", "enabled", "level", "code"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, ORDER, WEATHER, FLAGS]
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
ARITH = 'root ::= expr\nexpr ::= num | "(" expr ("+" | "*") expr ")"\nnum ::= [1-9] [0-9]?\n'
COLORS = ["red", "green", "blue"]


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _json_format(schema: dict[str, Any], name: str = "out") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _closers(tokenizer) -> dict[str, float]:
    """Bias towards '"' and '}': any JSON object has unbounded strings a random model may not close."""
    return {str(tokenizer.token_to_id('"')): 6.0, str(tokenizer.token_to_id("}")): 6.0}


def _generate(http: httpx.Client, endpoint: str, body: dict[str, Any]) -> list[str]:
    """Texts of the choices of a completions / chat request (200 and finish_reason "stop" asserted)."""
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "Answer:"}], **body}
        resp = http.post("/v1/chat/completions", json=body)
    else:
        resp = http.post("/v1/completions", json={"prompt": "Answer:", **body})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["message"]["content"] if endpoint == "chat" else c["text"] for c in choices]


def test_sdk_parse_returns_a_valid_instance(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="xllm-tiny",
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        temperature=0.0,
        max_tokens=200,
        extra_body=COMPACT,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Pet)
    assert message.parsed == Pet.model_validate_json(message.content)


def test_langchain_with_structured_output_round_trips(server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="xllm-tiny",
        base_url=server.base_url + "/v1",
        api_key="unused",
        temperature=0.0,
        max_tokens=200,
        extra_body=COMPACT,
    )
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def _kinds(tokenizer) -> dict[str, tuple[dict[str, Any], Any]]:
    def person(text: str) -> None:
        jsonschema.validate(json.loads(text), PERSON)

    return {
        "json_schema": ({"response_format": _json_format(PERSON), **COMPACT}, person),
        "json_object": (
            {"response_format": {"type": "json_object"}, **COMPACT, "logit_bias": _closers(tokenizer)},
            lambda text: isinstance(json.loads(text), dict) or pytest.fail(text),
        ),
        # guided_* and structured_outputs spell one field: guided_json takes guided_whitespace_pattern
        "guided_json": ({"guided_json": PERSON, "guided_whitespace_pattern": " ?"}, person),
        "regex": ({"structured_outputs": {"regex": DATE}}, lambda t: re.fullmatch(DATE, t) or pytest.fail(t)),
        "guided_regex": ({"guided_regex": DATE}, lambda t: re.fullmatch(DATE, t) or pytest.fail(t)),
        "choice": ({"guided_choice": COLORS}, lambda t: t in COLORS or pytest.fail(t)),
        "grammar": (
            {"structured_outputs": {"grammar": ARITH}},
            lambda t: (re.fullmatch(r"[0-9()+*]+", t) and eval(t) >= 1) or pytest.fail(t),  # noqa: S307
        ),
    }


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_kind_of_constraint_on_both_endpoints(http: httpx.Client, tokenizer, endpoint: str) -> None:
    for fields, check in _kinds(tokenizer).values():
        body = {"max_tokens": 120, "temperature": 0.8, "seed": 11, **fields}
        for text in _generate(http, endpoint, body):
            check(text)


def test_streamed_and_n_greater_than_one(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="xllm-tiny",
        messages=[{"role": "user", "content": "A person:"}],
        response_format=_json_format(WEATHER),
        extra_body=COMPACT,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=150,
        stream=True,
    )
    texts = ["", "", ""]
    finish = [None, None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["stop"] * 3
    for text in texts:
        jsonschema.validate(json.loads(text), WEATHER)
    assert len(set(texts)) > 1  # each sequence has its own matcher: they sample apart
    streamed = client.completions.create(
        model="xllm-tiny", prompt="Date:", extra_body={"guided_regex": DATE}, max_tokens=30, stream=True
    )
    assert re.fullmatch(DATE, "".join(c.choices[0].text for c in streamed))


@pytest.mark.parametrize(
    "body, param, reason",
    [
        ({"response_format": _json_format({"type": "foo"})}, "response_format", "Invalid type"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"guided_json": '{"type": "object", "properties": {"a": {"$ref": "#/x"}}}'}, "guided_json", "/x"),
        ({"guided_regex": "[0-9"}, "guided_regex", "unclosed"),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", "look-around"),
        ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "structured_outputs", "not found"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "unknown name"),
        ({"guided_choice": []}, "guided_choice", "1..1024 strings"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "set one of"),
        (
            {"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
            "guided_decoding_backend",
            "llguidance",
        ),
        (
            {"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "",
        ),
        ({"use_beam_search": True, "guided_regex": "a"}, "guided_regex", "beam search"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"bad1": 1, "5": 1, "bad2": 2}}, "logit_bias", "got 'bad1', 'bad2'$"),  # all named
        ({"logit_bias": {"5": 100.5}}, "logit_bias", r"\[-100, 100\]"),
        ({"logit_bias": {"5": -101}}, "logit_bias", r"\[-100, 100\]"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "vocabulary"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5", ""),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ({"allowed_token_ids": [3, 99999]}, "allowed_token_ids", "vocabulary"),
        ({"bad_words": ["  "]}, "bad_words", "blank"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(http: httpx.Client, body, param, reason) -> None:
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", None)):
        if base is None:
            if "use_beam_search" in body:
                continue  # beam search is served on /v1/completions only
            base = {"messages": [{"role": "user", "content": "hi"}]}
        resp = http.post(path, json={**base, "max_tokens": 5, **body})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param, error
        assert re.search(reason, error["message"]), error


def test_logit_bias_forces_a_token_and_allowed_ids_restrict(http: httpx.Client, tokenizer) -> None:
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    resp = http.post("/v1/completions", json={**body, "logit_bias": {"1234": 100}})
    assert resp.json()["choices"][0]["text"] == tokenizer.decode([1234] * 4)
    allowed = tokenizer.encode("ab", add_special_tokens=False) + tokenizer.encode(
        "c", add_special_tokens=False
    )
    resp = http.post("/v1/completions", json={**body, "max_tokens": 8, "allowed_token_ids": allowed})
    text = resp.json()["choices"][0]["text"]
    assert text and set(text) <= set("abc"), text


def test_bad_words_are_never_generated(http: httpx.Client, tokenizer) -> None:
    body = {"prompt": "Hello there", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    token = tokenizer.encode(free, add_special_tokens=False)[0]
    first = tokenizer.decode([token])
    assert first.strip() and tokenizer.encode(first, add_special_tokens=False) == [token]
    banned = http.post("/v1/completions", json={**body, "bad_words": [first]}).json()["choices"][0]["text"]
    assert banned != free and not banned.startswith(
        first
    )  # the exact token-level check: test_structured_engine


def test_batch_job_with_response_format(client: openai.OpenAI, tmp_path) -> None:
    from tests.xservice.batch.helpers import chat_line, read_file, submit, wait_batch, write_jsonl

    lines = [
        chat_line(
            f"s-{i}",
            f"Item {i}",
            150,
            response_format=_json_format(schema),
            seed=i,
            temperature=1.0,
            **COMPACT,
        )
        for i, schema in enumerate(SCHEMAS)
    ]
    batch = wait_batch(
        client, submit(client, write_jsonl(tmp_path / "in.jsonl", lines), "/v1/chat/completions").id
    )
    assert batch.status == "completed" and batch.request_counts.completed == len(SCHEMAS)
    for record, schema in zip(read_file(client, batch.output_file_id), SCHEMAS):
        choice = record["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def _validate_many(http: httpx.Client, num_samples: int, n: int = 8) -> None:
    """``num_samples`` sampled generations over the schemas, each parsed and validated."""
    checked = 0
    for i in range(num_samples // n):
        schema = SCHEMAS[i % len(SCHEMAS)]
        body = {
            "prompt": f"Record {i}:",
            "n": n,
            "temperature": 1.0,
            "seed": 100 + i,
            "max_tokens": 160,
            "response_format": _json_format(schema),
            **COMPACT,
        }
        for text in _generate(http, "completions", body):
            jsonschema.validate(json.loads(text), schema)
            checked += 1
    assert checked == num_samples


def test_40_constrained_generations_all_validate(http: httpx.Client) -> None:
    _validate_many(http, 40)


@pytest.mark.slow
def test_200_constrained_generations_all_validate(http: httpx.Client) -> None:
    _validate_many(http, 200)


def test_a_continued_request_resumes_its_grammar() -> None:
    """PD hand-off and migration continue a request on another instance (``InstancePool.continuation``)
    with the generated tokens appended to its prompt; its grammar must resume past them, not restart
    (the engine side: ``test_structured_engine.py::test_a_resumed_request_continues_its_grammar``)."""
    from xengine.api.messages import AddRequest, SamplingParams, StructuredOutputsParams
    from xservice.cluster.pool import InstancePool

    so = StructuredOutputsParams(regex="[a-z]+")
    params = SamplingParams(max_tokens=10, structured_outputs=so)
    req = AddRequest(req_id="r", prompt_token_ids=[1, 2], params=params)
    sub = InstancePool.continuation(req, [7, 8], "d1")
    assert sub is not None and sub.prompt_token_ids == [1, 2, 7, 8] and sub.params.max_tokens == 8
    assert sub.params.structured_outputs.resume_token_ids == [7, 8]
    assert req.params.structured_outputs.resume_token_ids is None  # the original request is untouched
    fresh = InstancePool.continuation(req, [], "m1")  # nothing generated yet: the grammar starts over
    assert fresh is not None and fresh.params.structured_outputs.resume_token_ids is None
