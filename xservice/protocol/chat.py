"""``/v1/chat/completions`` bodies."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from xservice.protocol.base import UNSUPPORTED_FIELDS, APIRequest, APIResponse, now
from xservice.protocol.common import Usage
from xservice.protocol.sampling import SamplingRequest


class ContentPart(APIRequest):
    """One part of a message's content; only ``text`` parts are supported by text models (other
    part types are refused by the prompt renderer, naming the part)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(APIRequest):
    ignored_fields: ClassVar[dict[str, str]] = {
        "refusal": "an earlier assistant refusal text; chat templates have no place for it",
    }
    unsupported_fields: ClassVar[dict[str, str]] = {
        "audio": "audio messages are not supported",
        "tool_calls": "not implemented yet",
        "function_call": "not implemented yet",
    }

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None


CHAT_UNSUPPORTED_FIELDS: dict[str, str] = {
    **UNSUPPORTED_FIELDS,
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not available",
    "verbosity": "this server has no verbosity control",
    "reasoning_effort": "this server has no reasoning-effort control",
    "include_reasoning": "reasoning parsers are not implemented",
    "mm_processor_kwargs": "multimodal inputs are not supported by this server's models",
    "best_of": "'best_of' is served on /v1/completions",
    "use_beam_search": "beam search is served on /v1/completions",
    "length_penalty": "beam search is served on /v1/completions",
    # --- being implemented (issue 12) ---
    "tools": "not implemented yet",
    "tool_choice": "not implemented yet",
    "parallel_tool_calls": "not implemented yet",
    "functions": "not implemented yet",
    "function_call": "not implemented yet",
    "chat_template": "not implemented yet",
    "chat_template_kwargs": "not implemented yet",
    "documents": "not implemented yet",
    "continue_final_message": "not implemented yet",
    "echo": "not implemented yet",
}


class ChatCompletionRequest(SamplingRequest):
    unsupported_fields: ClassVar[dict[str, str]] = CHAT_UNSUPPORTED_FIELDS

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    modalities: list[Literal["text"]] | None = None  # text is the only output modality


class TopLogprob(APIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(APIResponse):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(APIResponse):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(APIResponse):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(APIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(APIResponse):
    """A streamed message delta; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(APIResponse):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(APIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
