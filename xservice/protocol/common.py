"""Bodies shared by several routes: usage, models, tokenize / detokenize."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from xservice.protocol.base import APIResponse, drop_none, now


class PromptLogprob(APIResponse):
    """One entry of vLLM's ``prompt_logprobs``: a token's logprob at a prompt position, its rank in the
    vocabulary (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs`` response field: per prompt token, {token id: entry} for the prompt token
# and the top ``prompt_logprobs`` tokens at that position; null for the first token (nothing precedes it)
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class PromptTokensDetails(APIResponse):
    cached_tokens: int = 0


class CompletionTokensDetails(APIResponse):
    """With a reasoning parser (``service.reasoning_parser``): how many output tokens were reasoning."""

    reasoning_tokens: int = 0


class Usage(APIResponse):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # left out without a reasoning parser

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        reasoning_tokens: int | None = None,
    ) -> Usage:
        details = (
            None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=details,
        )

    @model_serializer(mode="wrap")
    def _drop_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return drop_none(handler(self), "completion_tokens_details")


class ModelCard(APIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "xllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(APIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PerRequestMetrics(APIResponse):
    """One request's timing (vLLM's ``--enable-per-request-metrics``): TTFT from its first scheduling,
    decode time (first to last token), time queued in the engine, mean inter-token latency, and output
    tokens per second from its first scheduling to its last token."""

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None

    @model_serializer(mode="wrap")
    def _drop_unmeasured(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A timing that was not measured (one token: no inter-token latency) is left out, as vLLM does."""
        out = handler(self)
        return drop_none(out, *list(out))


class TokenizeResponse(APIResponse):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str | None] | None = None  # with return_token_strs


class DetokenizeResponse(APIResponse):
    prompt: str
