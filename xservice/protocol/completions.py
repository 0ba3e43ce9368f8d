"""``/v1/completions`` bodies."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from xservice.protocol.base import APIResponse, drop_none, now
from xservice.protocol.common import PerRequestMetrics, PromptLogprobs, Usage
from xservice.protocol.sampling import SamplingRequest

PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput | None = None  # None: prompt_embeds only (one of the two is required)
    # vLLM's: prompts as embeddings, base64 of torch.save([tokens, hidden]) (``--enable-prompt-embeds``)
    prompt_embeds: str | list[str] | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # the tokenizer's special tokens (e.g. BOS) around a text prompt
    # beam search extras: ``n`` (or ``num_return_sequences``) choices, best first, each with a score
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    num_return_sequences: int | None = None


class CompletionLogprobs(APIResponse):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(APIResponse):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # with ``return_token_ids`` (null otherwise, as in vLLM): the prompt's and this choice's token ids
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    # beam search only (left out otherwise)
    score: float | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with ``prompt_logprobs`` (null otherwise, as in vLLM)

    @model_serializer(mode="wrap")
    def _drop_beam_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_none(handler(self), "score", "cumulative_logprob")


class CompletionResponse(APIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: PerRequestMetrics | None = None  # service.enable_per_request_metrics (left out otherwise)

    @model_serializer(mode="wrap")
    def _drop_metrics(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_none(handler(self), "metrics")
