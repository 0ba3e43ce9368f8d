"""Tool calling and chat-template controls through a real server with the ``openai`` client.

The server's model is the tiny Qwen3 checkpoint with a Qwen3-style template (``tools_server``), so
tools and tool results render as on a real Qwen3; ``transformers`` renders the same template as
the oracle. Calls forced by ``tool_choice`` ("required" / named) rely on structured outputs in the
engine; ``auto`` calls are made by the test itself, as an assistant prefix the model continues
(``continue_final_message`` + ``echo``), since a random model writes no calls of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

# Bounded strings and numbers: a random model under a schema constraint otherwise may never close a
# string within max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ARGS = '{"city": "Paris", "unit": "C"}'
HISTORY = [
    {"role": "system", "content": "You are helpful."},
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGS}},
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": 1}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def thttp(tools_server) -> httpx.Client:
    with tools_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def hf(tools_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_model_dir))


def hf_ids(hf, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    text = hf.apply_chat_template(messages, tokenize=False, **kw)
    return hf(text, add_special_tokens=False)["input_ids"]


def tokenize(http: httpx.Client, **body: Any) -> list[int]:
    resp = http.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def chat(client: openai.OpenAI, **kw: Any):
    return client.chat.completions.create(model="xllm-tiny", temperature=0.0, **kw)


def streamed_message(client: openai.OpenAI, **kw: Any) -> tuple[str | None, list[dict[str, str]], str | None]:
    """Stream a one-choice chat and add its deltas up: (content, calls, finish_reason)."""
    content, calls, finish = None, {}, None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for tc in delta.tool_calls or []:
                if tc.id is not None:  # a call's first delta: id, type and name
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def as_calls(message) -> list[dict[str, str]]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


# ---------------------------------------------------------------- rendering


def test_tools_and_history_render_as_transformers_does(thttp, hf) -> None:
    got = tokenize(thttp, messages=USER, tools=TOOLS)
    assert got == hf_ids(hf, USER, tools=TOOLS, add_generation_prompt=True)
    text = hf.decode(got)
    assert "<tools>" in text and '"name": "get_weather"' in text
    history = tokenize(thttp, messages=HISTORY, tools=TOOLS)
    expected_history = [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in HISTORY
    ]  # transformers' convention: arguments as a mapping
    assert history == hf_ids(hf, expected_history, tools=TOOLS, add_generation_prompt=True)
    rendered = hf.decode(history)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n12:00" in rendered


def test_tool_choice_none_offers_no_tools(client, thttp) -> None:
    plain = len(tokenize(thttp, messages=USER))
    with_tools = len(tokenize(thttp, messages=USER, tools=TOOLS))
    none = chat(client, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=2)
    auto = chat(client, messages=USER, tools=TOOLS, max_tokens=2)
    assert none.usage.prompt_tokens == plain < with_tools == auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)


def test_history_with_tool_calls_is_served(client) -> None:
    resp = chat(client, messages=HISTORY, tools=TOOLS, max_tokens=3)
    assert resp.choices[0].message.content is not None and resp.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- auto: calls parsed from the output


def test_auto_calls_are_parsed_streamed_and_reassembled(client) -> None:
    """The model continues an assistant message that already holds two calls; the echoed message is
    parsed like any output, whole and streamed."""
    prefix = (
        "Checking.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    )
    messages = [*USER, {"role": "assistant", "content": prefix}]
    kw = dict(
        messages=messages,
        tools=TOOLS,
        max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    resp = chat(client, **kw)
    message = resp.choices[0].message
    expected = [
        {"name": "get_weather", "arguments": CALL_ARGS},
        {"name": "get_time", "arguments": '{"zone": 1}'},
    ]
    assert as_calls(message) == expected
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    assert message.content.startswith("Checking.")
    assert resp.choices[0].finish_reason == "length"  # cut off by max_tokens: not "tool_calls"
    assert streamed_message(client, **kw) == (message.content, expected, "length")
    one = chat(client, parallel_tool_calls=False, **kw).choices[0].message
    assert as_calls(one) == expected[:1]


def test_auto_without_calls_is_plain_content(client) -> None:
    resp = chat(client, messages=USER, tools=TOOLS, max_tokens=4)
    plain = chat(client, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    message = resp.choices[0].message
    assert message.tool_calls is None and message.content and resp.choices[0].finish_reason == "length"
    assert streamed_message(client, messages=USER, tools=TOOLS, max_tokens=4) == (
        message.content,
        [],
        "length",
    )
    assert plain.choices[0].message.tool_calls is None


# ---------------------------------------------------------------- forced calls (structured outputs)


def check_calls(calls: list[dict[str, str]], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_are_valid_and_stream(client, parallel: bool) -> None:
    kw = dict(
        messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200
    )
    resp = chat(client, **kw)
    choice = resp.choices[0]
    calls = as_calls(choice.message)
    check_calls(calls, {"get_weather", "get_time"})
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    if not parallel:
        assert len(calls) == 1
    assert streamed_message(client, **kw) == (None, calls, "tool_calls")


def test_named_tool_choice_calls_that_tool(client) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=200)
    resp = chat(client, **kw)
    calls = as_calls(resp.choices[0].message)
    check_calls(calls, {"get_time"})
    assert len(calls) == 1
    assert streamed_message(client, **kw) == (None, calls, "tool_calls")


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "change,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        (
            {"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
            "messages.0.function_call",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, *USER]}, None),  # empty list: fine
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [HISTORY[2]["tool_calls"][0]]}]},
            "messages.0.tool_calls",
        ),
        ({"chat_template_kwargs": {"not_in_template": 1}}, "chat_template_kwargs.not_in_template"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"documents": [{"text": "d"}]}, "documents"),
        (
            {"continue_final_message": True},
            "continue_final_message",
        ),  # add_generation_prompt defaults to true
        ({"echo": True}, "echo"),
    ],
)
def test_bad_tool_and_template_fields_are_400s(thttp, change: dict[str, Any], param: str | None) -> None:
    body = {"messages": USER, "max_tokens": 1, **change}
    resp = thttp.post("/v1/chat/completions", json=body)
    if param is None:
        assert resp.status_code == 200, resp.text
        return
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


# ---------------------------------------------------------------- template controls


def test_chat_template_kwargs_reach_the_template(thttp, hf) -> None:
    off = tokenize(thttp, messages=USER, chat_template_kwargs={"enable_thinking": False})
    assert off == hf_ids(hf, USER, add_generation_prompt=True, enable_thinking=False)
    assert hf.decode(off).endswith("<think>\n\n</think>\n\n")


def test_request_chat_template_and_documents(thttp, http) -> None:
    template = (
        "{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    body = {"messages": USER, "chat_template": template, "documents": [{"title": "A", "text": "alpha"}]}
    ids = tokenize(thttp, **body)
    resp = thttp.post("/detokenize", json={"tokens": ids})
    assert resp.json()["prompt"] == f"[doc A: alpha]<user>{USER[0]['content']}"
    chat_resp = thttp.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert chat_resp.status_code == 200 and chat_resp.json()["usage"]["prompt_tokens"] == len(ids)
    # the shared server does not trust request templates
    refused = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    bad = thttp.post("/v1/chat/completions", json={"messages": USER, "chat_template": "{% if %}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"


def test_continue_final_message_and_echo(client, thttp, hf) -> None:
    saying = "An apple a day, keeps"
    messages = [{"role": "user", "content": "Tell me a saying."}, {"role": "assistant", "content": saying}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    ids = tokenize(thttp, messages=messages, **flags)
    assert ids == hf_ids(hf, messages, continue_final_message=True)
    assert hf.decode(ids).endswith(saying)
    for echo in (True, False):
        resp = chat(client, messages=messages, max_tokens=3, extra_body={**flags, "echo": echo})
        content = resp.choices[0].message.content
        assert resp.usage.prompt_tokens == len(ids)
        assert content.startswith(saying) == echo
        streamed, _, _ = streamed_message(
            client, messages=messages, max_tokens=3, extra_body={**flags, "echo": echo}
        )
        assert streamed == content
