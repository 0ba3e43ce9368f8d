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


# ---------------------------------------------------------------- reasoning in input messages

# Renders both names, so a test sees that each reaches the template under both keys (as in vLLM).
REASONING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.reasoning_content is string %}[rc:{{ m.reasoning_content }}]{% endif %}"
    "{% if m.reasoning is string %}[r:{{ m.reasoning }}]{% endif %}"
    "{{ m.content }}{% endfor %}"
)


@pytest.fixture(scope="module")
def thttp(tools_server):
    """Raw HTTP to the server that trusts request chat templates."""
    with tools_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def hf(tools_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_model_dir))


def _history(**thinking: str | None) -> list[dict]:
    return [*USER, {"role": "assistant", "content": "2", **thinking}, {"role": "user", "content": "And 2+2?"}]


def _tokenize(http, messages: list[dict], **body) -> list[int]:
    resp = http.post("/tokenize", json={"messages": messages, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def _hf_ids(hf, messages: list[dict], **kw) -> list[int]:
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "thinking",
    [
        {"reasoning": "one and one"},
        {"reasoning_content": "one and one"},
        {"reasoning": "one and one", "reasoning_content": "one and one"},
        {"reasoning": None, "reasoning_content": "one and one"},
    ],
)
def test_reasoning_in_messages_reaches_the_template(thttp, hf, thinking: dict) -> None:
    both = _history(reasoning="one and one", reasoning_content="one and one")  # what the template sees
    got = _tokenize(thttp, _history(**thinking), chat_template=REASONING_TEMPLATE)
    assert got == _hf_ids(hf, both, chat_template=REASONING_TEMPLATE)
    assert "[rc:one and one][r:one and one]2" in hf.decode(got)
    # the model's own (Qwen3-style) template: same prompt as transformers renders, and served by chat
    ids = _tokenize(thttp, _history(**thinking))
    assert ids == _hf_ids(hf, both)
    assert "<|im_start|>assistant\n<think>\none and one\n</think>\n\n2<|im_end|>" in hf.decode(ids)
    resp = thttp.post("/v1/chat/completions", json={"messages": _history(**thinking), "max_tokens": 1})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == len(ids), resp.text


def test_null_reasoning_renders_as_none(thttp, hf) -> None:
    got = _tokenize(thttp, _history(reasoning=None, reasoning_content=None), chat_template=REASONING_TEMPLATE)
    assert got == _hf_ids(hf, _history(), chat_template=REASONING_TEMPLATE)
    assert "[r" not in hf.decode(got)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": "hi", "reasoning": "x"}], "messages.0.reasoning"),
        (
            [{"role": "system", "content": "s", "reasoning_content": "x"}, *USER],
            "messages.0.reasoning_content",
        ),
        (_history(reasoning="a", reasoning_content="b"), "messages.1.reasoning_content"),
        (_history(reasoning=["a"]), "messages.1.reasoning"),
    ],
)
def test_bad_reasoning_in_messages_is_a_400(thttp, messages: list[dict], param: str) -> None:
    for route, extra in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        resp = thttp.post(route, json={"messages": messages, **extra})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.text
