"""``/v1/responses`` through a real server with the ``openai`` client: text (same tokens as chat for the
same conversation), OpenAI's event sequence when streamed, tool calls, ``text.format`` and refusals."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.xservice.serving.test_api_tools import TOOLS as CHAT_TOOLS

TOOLS = [
    {"type": "function", "strict": None, **t["function"]} for t in CHAT_TOOLS
]  # flat, as Responses has them
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def thttp(tools_server) -> httpx.Client:
    with tools_server.client() as c:
        yield c


def create(client: openai.OpenAI, **kw: Any):
    return client.responses.create(model="xllm-tiny", temperature=0.0, **kw)


def test_text_matches_chat(client) -> None:
    resp = create(client, input=QUESTION, instructions="Be brief.", max_output_tokens=6)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model="xllm-tiny", messages=messages, temperature=0.0, max_tokens=6)
    assert resp.id.startswith("resp_") or resp.id.startswith("resp-")
    assert resp.object == "response" and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert len(resp.output) == 1 and resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens and resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6


def test_stream_events_follow_openai_sequence(client) -> None:
    kw = dict(
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}], max_output_tokens=6
    )
    whole = create(client, **kw)
    events = list(create(client, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 6
    # the SDK's stream helper accumulates the same text
    with client.responses.stream(model="xllm-tiny", temperature=0.0, **kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text


def test_history_items_render_like_chat(client, thttp) -> None:
    """function_call / function_call_output items are the chat history's tool_calls / tool messages."""
    args = '{"city": "Paris", "unit": "C"}'
    items = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args, "id": "fc_1",
         "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]  # fmt: skip
    resp = create(client, input=items, tools=TOOLS, max_output_tokens=2)
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    tokens = thttp.post("/tokenize", json={"messages": messages, "tools": CHAT_TOOLS}).json()["tokens"]
    assert resp.usage.input_tokens == len(tokens)
    rendered = thttp.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "<tool_response>\nsunny\n</tool_response>" in rendered


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls(client, stream: bool) -> None:
    kw = dict(
        input=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=200
    )
    if stream:
        events = list(create(client, stream=True, **kw))
        kinds = [e.type for e in events]
        assert kinds[-1] == "response.completed"
        added = [e for e in events if e.type == "response.output_item.added"]
        assert [e.item.type for e in added] == ["function_call"]
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == args
        output = events[-1].response.output
    else:
        output = create(client, **kw).output
    assert len(output) == 1 and output[0].type == "function_call" and output[0].status == "completed"
    call = output[0]
    assert call.call_id.startswith("call_") and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_stream_helper_final_response(client) -> None:
    choice = {"type": "function", "name": "get_time"}
    with client.responses.stream(
        model="xllm-tiny",
        input=QUESTION,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0.0,
        max_output_tokens=200,
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and [o.name for o in final.output] == ["get_time"]
    jsonschema.validate(json.loads(final.output[0].arguments), SCHEMAS["get_time"])


def test_text_format_json_schema(client) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 6}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}}
    resp = create(client, input=QUESTION, text=fmt, max_output_tokens=200)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_vllm_sampling_extensions(client) -> None:
    """top_k / min_p / repetition_penalty / seed act as on chat completions (vLLM accepts them here too)."""
    kw = {"input": QUESTION, "max_output_tokens": 8, "extra_body": {}}
    greedy = create(client, **kw).output_text
    top1 = client.responses.create(model="xllm-tiny", temperature=1.0, **{**kw, "extra_body": {"top_k": 1}})
    assert top1.output_text == greedy  # top_k=1 samples the argmax
    seeded = [
        client.responses.create(
            model="xllm-tiny", temperature=1.0, **{**kw, "extra_body": {"seed": 7}}
        ).output_text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    messages = [{"role": "user", "content": QUESTION}]
    extra = {"seed": 7, "min_p": 0.05, "repetition_penalty": 1.3}
    chat = client.chat.completions.create(
        model="xllm-tiny", messages=messages, temperature=1.0, max_tokens=8, extra_body=extra
    )
    resp = client.responses.create(model="xllm-tiny", temperature=1.0, **{**kw, "extra_body": extra})
    assert resp.output_text == chat.choices[0].message.content


def test_chat_template_kwargs_reach_the_template(client) -> None:
    kwargs = {
        "chat_template_kwargs": {"enable_thinking": False}
    }  # Qwen3's template adds an empty think block
    resp = create(client, input=QUESTION, max_output_tokens=1, extra_body=kwargs)
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(
        model="xllm-tiny", messages=messages, max_tokens=1, extra_body=kwargs
    )
    plain = create(client, input=QUESTION, max_output_tokens=1)
    assert resp.usage.input_tokens == chat.usage.prompt_tokens != plain.usage.input_tokens


@pytest.mark.parametrize(
    "change,param",
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"not_a_field": 1}, "not_a_field"),
        ({"top_k": -5}, "top_k"),
        ({"chat_template_kwargs": {"no_such_variable": True}}, "chat_template_kwargs.no_such_variable"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(thttp, change: dict[str, Any], param: str) -> None:
    resp = thttp.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 1, **change})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_nothing_is_stored(thttp) -> None:
    resp = thttp.post(
        "/v1/responses", json={"input": "hi", "max_output_tokens": 1, "store": True, "metadata": {"a": "b"}}
    )
    assert resp.status_code == 200, resp.text
    rid = resp.json()["id"]
    for method, path in [("GET", f"/v1/responses/{rid}"), ("DELETE", f"/v1/responses/{rid}")]:
        got = thttp.request(method, path)
        assert got.status_code == 404 and "does not store responses" in got.json()["error"]["message"]
