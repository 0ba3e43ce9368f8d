"""``/v1/chat/completions`` bodies."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from xservice.protocol.base import UNSUPPORTED_FIELDS, APIRequest, APIResponse, drop_none, now
from xservice.protocol.common import PerRequestMetrics, PromptLogprobs, Usage
from xservice.protocol.sampling import SamplingRequest
from xservice.protocol.tools import ChatTool, DeltaToolCall, MessageToolCall, ToolCall, ToolChoice


class ImageURL(APIRequest):
    """An ``image_url`` part's image: a ``data:image/...;base64,`` URL, or a file under the server's
    ``service.allowed_local_media_path`` (never fetched from the network)."""

    url: str
    # "auto" / "high": the model's own preprocessing (native resolution within its max_pixels);
    # "low" (OpenAI's fixed 512x512 budget) has no counterpart here. Checked by the renderer
    # (``xservice/serving/images.py``), so a 400 names this field rather than the content union.
    detail: str | None = None


class ContentPart(APIRequest):
    """One part of a message's content: ``text``, or ``image_url`` for vision-language models (other
    part types, and images sent to a text model, are refused by the prompt renderer, naming the part)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


# OpenAI deprecated ``functions`` / ``function_call`` for ``tools`` / ``tool_choice``; refused rather
# than mapped, since the legacy response shape (``message.function_call``) would be needed too.
_LEGACY_FUNCTIONS = "deprecated by OpenAI; use 'tools' / 'tool_choice' (and 'tool_calls' in messages)"


class ChatMessage(APIRequest):
    ignored_fields: ClassVar[dict[str, str]] = {
        "refusal": "an earlier assistant refusal text; chat templates have no place for it",
    }
    unsupported_fields: ClassVar[dict[str, str]] = {
        "audio": "audio messages are not supported",
        "function_call": _LEGACY_FUNCTIONS,
    }

    # "system", "developer", "user", "assistant", "tool", or any other role: passed to the chat template,
    # which decides what it makes of it (as vLLM)
    role: str = Field(min_length=1)
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # calls an earlier assistant turn made
    # An earlier assistant turn's thinking, as our responses carry it (multi-turn clients send it back);
    # both names reach the template as both keys, as in vLLM (Qwen3's reads 'reasoning_content').
    reasoning: str | None = None
    reasoning_content: str | None = None


CHAT_UNSUPPORTED_FIELDS: dict[str, str] = {
    **UNSUPPORTED_FIELDS,
    "prompt_embeds": "prompt embeddings are accepted on /v1/completions only (as in vLLM)",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not available",
    "verbosity": "this server has no verbosity control",
    "reasoning_effort": "this server has no reasoning-effort control",
    "mm_processor_kwargs": "per-request image processor settings are not supported (the model's "
    "preprocessor_config.json applies)",
    "best_of": "'best_of' is served on /v1/completions",
    "use_beam_search": "beam search is served on /v1/completions",
    "length_penalty": "beam search is served on /v1/completions",
    "functions": _LEGACY_FUNCTIONS,
    "function_call": _LEGACY_FUNCTIONS,
}


class ChatCompletionRequest(SamplingRequest):
    unsupported_fields: ClassVar[dict[str, str]] = CHAT_UNSUPPORTED_FIELDS

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    # special tokens added by the tokenizer on top of the chat template's (vLLM's default: none)
    add_special_tokens: bool = False
    modalities: list[Literal["text"]] | None = None  # text is the only output modality
    # Tool calling (see xservice/serving/tools/): definitions rendered by the chat template, calls
    # parsed from the output; "required" / a named tool constrain the output to valid calls.
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    # Chat template controls (vLLM's extensions)
    chat_template: str | None = None  # replaces the model's template (service.trust_request_chat_template)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    documents: list[dict[str, Any]] | None = None  # the template's 'documents' variable (RAG templates)
    continue_final_message: bool = False  # the prompt ends inside the last message, which is continued
    echo: bool = False  # with continue_final_message: the content starts with the continued message
    # With a reasoning parser (service.reasoning_parser): false drops the reasoning from the response
    # (its tokens still count in usage); without one there is nothing to split and it changes nothing.
    include_reasoning: bool = True


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
    # With a reasoning parser: the thinking text, under vLLM 0.33's name and the older / DeepSeek API's
    # name (both left out when there is none).
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out when the model called no tool

    @model_serializer(mode="wrap")
    def _drop_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_none(handler(self), "tool_calls", "reasoning", "reasoning_content")


class ChatChoice(APIResponse):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with ``return_token_ids`` (null otherwise, as in vLLM)


class ChatCompletionResponse(APIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with ``return_token_ids`` (null otherwise, as in vLLM)
    prompt_logprobs: PromptLogprobs | None = None  # with ``prompt_logprobs`` (null otherwise, as in vLLM)
    metrics: PerRequestMetrics | None = None  # service.enable_per_request_metrics (left out otherwise)

    @model_serializer(mode="wrap")
    def _drop_metrics(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_none(handler(self), "metrics")


class ChatDelta(APIResponse):
    """A streamed message delta; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # with a reasoning parser (vLLM 0.33's name) ...
    reasoning_content: str | None = None  # ... and the same text under the older / DeepSeek API's name
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(APIResponse):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with ``return_token_ids``: this chunk's tokens (left out otherwise)

    @model_serializer(mode="wrap")
    def _drop_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_none(handler(self), "token_ids")


class ChatCompletionChunk(APIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # with ``return_token_ids``: the prompt's token ids, on the first chunk only (left out otherwise)
    prompt_token_ids: list[int] | None = None
    metrics: PerRequestMetrics | None = None  # on the final usage chunk (enable_per_request_metrics)

    @model_serializer(mode="wrap")
    def _drop_prompt_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_none(handler(self), "prompt_token_ids", "metrics")
