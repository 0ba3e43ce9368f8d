"""Bodies shared by several routes: usage, models, tokenize / detokenize."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from xservice.protocol.base import APIResponse, now


class PromptTokensDetails(APIResponse):
    cached_tokens: int = 0


class Usage(APIResponse):
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


class ModelCard(APIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "xllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(APIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(APIResponse):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(APIResponse):
    prompt: str
