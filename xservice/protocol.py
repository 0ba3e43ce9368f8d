"""Request and response bodies of the HTTP API (pydantic, following OpenAI's schema).

Requests are validated strictly (no "5" for 5, no "yes" for true) so type mistakes become 400s;
unknown fields are ignored like OpenAI does. vLLM-style sampling extras (``top_k``, ``min_p``,
``repetition_penalty``, ...) and ``priority`` are accepted on both generation endpoints.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from xservice.request_model import RequestModel


class _Request(RequestModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------ requests


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Literal["online", "offline"] = "online"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    # beam search extras: ``n`` (or ``num_return_sequences``) choices, best first, each with a score
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    num_return_sequences: int | None = None


class ContentPart(_Request):
    """One part of a message's content; only ``text`` parts are supported by text models."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------ responses


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(_Response):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # beam search only (left out otherwise)
    score: float | None = None
    cumulative_logprob: float | None = None

    @model_serializer(mode="wrap")
    def _drop_beam_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in ("score", "cumulative_logprob"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


def _now() -> int:
    return int(time.time())


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    """A streamed message delta; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "xllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model."""
    return model.model_dump(mode="json")
