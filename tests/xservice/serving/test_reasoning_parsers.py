"""Reasoning splitters on whole outputs and token-by-token streams (tags split across deltas)."""

from __future__ import annotations

import asyncio

import pytest

from xservice.serving.chat_output import ChatOutput
from xservice.serving.reasoning.registry import plan_reasoning, resolve_family, setting_names
from xservice.serving.reasoning.tokens import count_reasoning_tokens
from xservice.serving.tools.plan import NO_TOOLS

QWEN3 = resolve_family("qwen3")
R1 = resolve_family("deepseek_r1")


def streamed(family, text: str, step: int, thinking: bool = True) -> tuple[str | None, str | None]:
    splitter = plan_reasoning(family, {"enable_thinking": thinking}, True).new_splitter()
    parts = {"reasoning": "", "content": ""}
    pieces = []
    for i in range(0, len(text), step):
        pieces += splitter.feed(text[i : i + step])
    for part, piece in pieces + splitter.finish():
        parts[part] += piece
    return parts["reasoning"] or None, parts["content"] or None


CASES = [
    # (family, output, thinking, reasoning, content)
    ("qwen3", "<think>a < b</think>answer", True, "a < b", "answer"),
    ("qwen3", "plan</think>\n\nanswer</think>!", True, "plan", "\n\nanswer!"),  # repeated end tag dropped
    ("qwen3", "<think>still thinking <", True, "still thinking <", None),  # never closed: all reasoning
    ("qwen3", "<think>x</think>", True, "x", None),
    ("qwen3", "<think>x</think>y", False, None, "<think>x</think>y"),  # enable_thinking: false
    ("qwen3", "hm<tool_call>\n{}</tool_call>", True, "hm", "<tool_call>\n{}</tool_call>"),  # implicit end
    ("deepseek_r1", "r1 thinks</think>then answers</think>", True, "r1 thinks", "then answers</think>"),
    ("deepseek_r1", "<think>a</think>b", False, "a", "b"),  # R1 does not read enable_thinking
    ("deepseek_r1", "<thin", True, "<thin", None),  # a held-back tag prefix comes out at the end
]


@pytest.mark.parametrize(("name", "text", "thinking", "reasoning", "content"), CASES)
def test_split_whole_and_streamed_agree(name, text, thinking, reasoning, content) -> None:
    family = resolve_family(name)
    plan = plan_reasoning(family, {"enable_thinking": thinking}, True)
    assert plan.split(text) == (reasoning, content)
    for step in (1, 2, 3, 7):  # every way a tag can fall across deltas
        assert streamed(family, text, step, thinking) == (reasoning, content), step


def test_no_tag_text_is_held_back_and_tag_prefixes_are() -> None:
    splitter = plan_reasoning(QWEN3, None, True).new_splitter()
    assert splitter.feed("<thi") == []  # may open a tag
    assert splitter.feed("nk>ab</") == [("reasoning", "ab")]
    assert splitter.feed("think>c") == [("content", "c")]
    assert splitter.ended


def test_settings_and_include_reasoning() -> None:
    assert setting_names() == ["none", "deepseek_r1", "qwen3"]
    assert resolve_family("none") is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        resolve_family("granite")
    assert plan_reasoning(None, None, True) is None
    assert plan_reasoning(QWEN3, None, False).split("a</think>b") == (None, "b")


def test_chat_output_splits_then_parses_tool_calls_from_the_content() -> None:
    from xservice.serving.tools.registry import resolve_family as tool_family

    hermes = tool_family("hermes", None, "")
    plan = NO_TOOLS.__class__("auto", [], None, None, hermes)
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text = f"<think>I mention <tool_call> in thought? no: {{}}</think>ok{call}"
    # qwen3 ends the reasoning at a <tool_call> written inside it; R1 keeps it as reasoning
    message, reason = ChatOutput(plan, reasoning=plan_reasoning(R1, None, True)).message(text, "stop")
    assert message.reasoning == message.reasoning_content == "I mention <tool_call> in thought? no: {}"
    assert message.content == "ok"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("f", '{"x": 1}')]
    assert reason == "tool_calls"
    stream = ChatOutput(plan, reasoning=plan_reasoning(R1, None, False)).choice_stream()
    outs = [stream.step(ch) + (stream.reasoning,) for ch in text] + [
        stream.step("", "stop") + (stream.reasoning,)
    ]
    assert all(r is None for *_, r in outs)  # include_reasoning: false
    assert "".join(c or "" for c, *_ in outs) == "ok"
    assert outs[-1][2] == "tool_calls"


def test_reasoning_tokens_map_the_span_to_tokens() -> None:
    vocab = ["<think>", "ab", "c", "</think>", "d"]

    async def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    text = "".join(vocab)
    span = plan_reasoning(QWEN3, None, True).span(text)
    assert asyncio.run(count_reasoning_tokens(decode, [0, 1, 2, 3, 4], span)) == 2
    spelled = ["<", "think", ">", "ab", "</", "think>", "d"]  # tags spelled in several tokens

    async def decode2(ids: list[int]) -> str:
        return "".join(spelled[i] for i in ids)

    assert asyncio.run(count_reasoning_tokens(decode2, list(range(7)), span)) == 1
    assert asyncio.run(count_reasoning_tokens(decode, [1, 2], (0, 0))) == 0
