"""LangChain's OpenAI chat model against a real server: ``bind_tools`` round trips (calls parsed into
``AIMessage.tool_calls``, results sent back as ``ToolMessage``s), streamed calls, and
``with_structured_output(..., method="function_calling")``."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

QUESTION = "What is the weather in Paris?"


# Bounded fields and closed objects, so a random model's constrained calls end within max_tokens.
class GetWeather(BaseModel):
    """Current weather of a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)
    unit: Literal["C", "F"]


class GetTime(BaseModel):
    """Current time in a time zone."""

    model_config = ConfigDict(extra="forbid")
    zone: int = Field(ge=-12, le=14)


class Reply(BaseModel):
    """A short answer and how sure it is."""

    model_config = ConfigDict(extra="forbid")
    answer: str = Field(max_length=8)
    sure: bool


TOOL_MODELS = {"GetWeather": GetWeather, "GetTime": GetTime}


@pytest.fixture(scope="module")
def llm(tools_server) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=tools_server.base_url + "/v1",
        api_key="unused",
        model="xllm-tiny",
        temperature=0.0,
        max_tokens=200,
        max_retries=0,
        timeout=120,
    )


def check_tool_calls(message: AIMessage) -> None:
    assert message.tool_calls and not message.invalid_tool_calls
    for call in message.tool_calls:
        TOOL_MODELS[call["name"]].model_validate(call["args"])  # parsed args follow the tool's schema
        assert call["id"].startswith("call_")


def test_bind_tools_round_trip(llm: ChatOpenAI) -> None:
    forced = llm.bind_tools([GetWeather, GetTime], tool_choice="any")  # LangChain's "any" = "required"
    history = [HumanMessage(QUESTION)]
    ai = forced.invoke(history)
    check_tool_calls(ai)
    history += [ai, *(ToolMessage(f"result {i}", tool_call_id=c["id"]) for i, c in enumerate(ai.tool_calls))]
    follow_up = llm.bind_tools([GetWeather, GetTime]).invoke(history, max_tokens=4)
    assert isinstance(follow_up, AIMessage) and isinstance(follow_up.content, str)
    assert follow_up.response_metadata["finish_reason"] == "length"


def test_tool_calls_stream(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([GetWeather, GetTime], tool_choice="GetWeather")
    whole = bound.invoke(QUESTION)
    chunks = list(bound.stream(QUESTION))
    assert len([c for c in chunks if c.tool_call_chunks]) > 1  # arguments arrive in pieces
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    check_tool_calls(whole)
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls
    ]
    assert [c["name"] for c in whole.tool_calls] == ["GetWeather"]


def test_history_from_langchain_is_accepted(llm: ChatOpenAI) -> None:
    """LangChain's serialization of earlier calls and their results (no constrained decoding involved)."""
    ai = AIMessage(
        "", tool_calls=[{"name": "GetWeather", "args": {"city": "Paris", "unit": "C"}, "id": "call_1"}]
    )
    history = [HumanMessage(QUESTION), ai, ToolMessage("sunny", tool_call_id="call_1")]
    reply = llm.bind_tools([GetWeather]).invoke(history, max_tokens=3)
    assert reply.response_metadata["finish_reason"] == "length" and reply.usage_metadata["output_tokens"] == 3


def test_with_structured_output_function_calling(llm: ChatOpenAI) -> None:
    structured = llm.with_structured_output(Reply, method="function_calling")
    reply = structured.invoke(QUESTION)
    assert isinstance(reply, Reply)
