"""Reasoning parsers through a real server (``service.reasoning_parser: qwen3``) and the ``openai`` client.

A random model writes no think tags of its own, so a regex constraint (``structured_outputs``) makes
it: the output really is ``<think>...</think>...``, and its split, streamed or whole, is checked
against the raw text the same request gives on a server without a reasoning parser.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

USER = [{"role": "user", "content": "What is 1+1?"}]
THINK = r"<think>[a-z ]{1,20}</think>[a-z ]{1,10}"
FORCED = {"structured_outputs": {"regex": THINK}}
SPLIT = re.compile(r"<think>(.*)</think>(.*)", re.S)


@pytest.fixture(scope="module")
def reasoning_server(launch_server, tools_model_dir):
    handle = launch_server(
        tools_model_dir, {"reasoning_parser": "qwen3"}, engine={"model": {"max_model_len": 2048}}
    )
    yield handle
    handle.stop()


def _client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(reasoning_server) -> openai.OpenAI:
    return _client(reasoning_server)


@pytest.fixture(scope="module")
def plain(tools_server) -> openai.OpenAI:
    """The same model on a server without a reasoning parser."""
    return _client(tools_server)


def _chat(client: openai.OpenAI, **kw):
    kw.setdefault("extra_body", FORCED)
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model="", messages=USER, temperature=0, **kw)


def _streamed(client: openai.OpenAI, **kw) -> tuple[str, str, dict | None]:
    reasoning, content, usage = [], [], None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning.append(delta.get("reasoning") or "")
            if reasoning[-1]:
                assert not "".join(content), "reasoning after content"
            content.append(delta.get("content") or "")
    return "".join(reasoning), "".join(content), usage


def test_reasoning_is_split_out_of_the_content(client, plain) -> None:
    raw = _chat(plain).choices[0].message
    m = SPLIT.fullmatch(raw.content)
    assert m is not None, raw.content  # the constraint really wrote think tags
    assert getattr(raw, "reasoning", None) is None and getattr(raw, "reasoning_content", None) is None
    resp = _chat(client)
    message = resp.choices[0].message.model_dump()
    assert (message["reasoning"], message["content"]) == (m.group(1), m.group(2))
    assert message["reasoning_content"] == message["reasoning"]
    details = resp.usage.completion_tokens_details
    assert details is not None and 0 < details.reasoning_tokens < resp.usage.completion_tokens
    assert _streamed(client) == (m.group(1), m.group(2), resp.usage.model_dump())
    assert _chat(plain).usage.completion_tokens_details is None  # no parser: no details


def test_include_reasoning_false_drops_it(client) -> None:
    full = _chat(client).choices[0].message
    resp = _chat(client, extra_body={**FORCED, "include_reasoning": False})
    message = resp.choices[0].message.model_dump()
    assert message.get("reasoning") is None and message.get("reasoning_content") is None
    assert message["content"] == full.content
    assert resp.usage.completion_tokens_details.reasoning_tokens > 0  # still counted, as in vLLM
    reasoning, content, _ = _streamed(client, extra_body={**FORCED, "include_reasoning": False})
    assert (reasoning, content) == ("", full.content)


def test_enable_thinking_false_leaves_the_output_as_content(client, plain) -> None:
    body = {**FORCED, "chat_template_kwargs": {"enable_thinking": False}}
    raw = _chat(plain, extra_body=body).choices[0].message.content
    message = _chat(client, extra_body=body).choices[0].message.model_dump()
    assert message.get("reasoning") is None and message["content"] == raw


def test_unclosed_reasoning_has_no_content(client) -> None:
    resp = _chat(client, extra_body={"structured_outputs": {"regex": r"<think>[a-z]{30}"}}, max_tokens=3)
    message = resp.choices[0].message.model_dump()
    assert message["content"] is None and message["reasoning"]  # cut off while thinking
    assert resp.choices[0].finish_reason == "length"


def test_include_reasoning_without_parser_changes_nothing(plain) -> None:
    a = _chat(plain).choices[0].message.content
    assert _chat(plain, extra_body={**FORCED, "include_reasoning": False}).choices[0].message.content == a
    assert _chat(plain, extra_body={**FORCED, "include_reasoning": True}).choices[0].message.content == a


def test_tool_calls_are_parsed_from_the_content_after_reasoning(client) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    prefix = '<think>call f</think>Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    messages = [*USER, {"role": "assistant", "content": prefix}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    resp = client.chat.completions.create(
        model="", messages=messages, tools=[tool], max_tokens=2, extra_body=extra
    )
    message = resp.choices[0].message.model_dump()
    assert message["reasoning"] == "call f"
    assert message["content"].startswith("Sure.") and "<think>" not in message["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("f", '{"x": 1}')
    ]


def test_bad_include_reasoning_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError, match="include_reasoning"):
        _chat(client, extra_body={"include_reasoning": "maybe"})


def test_json_constraints_leave_no_room_for_reasoning(client) -> None:
    """A JSON schema constrains the output from its first token: it is the content, not reasoning
    (the OpenAI SDK's ``parse()`` reads ``content``), also when streamed."""
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    message = _chat(client, extra_body=compact, response_format=fmt).choices[0].message
    assert json.loads(message.content)["a"] in (1, 2, 3)
    assert getattr(message, "reasoning", None) is None
    reasoning, content, _ = _streamed(client, extra_body=compact, response_format=fmt)
    assert (reasoning, content) == ("", message.content)
