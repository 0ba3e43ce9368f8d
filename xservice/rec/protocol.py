"""Request and response bodies of ``/v1/rec/*`` (pydantic; strict like the OpenAI routes)."""

from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from xservice.protocol.request_model import RequestModel


class _Request(RequestModel):
    """Strict types; unknown fields refused (``RequestModel``'s field rule)."""


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CatalogCreateRequest(_Request):
    name: str
    items: list[list[int]]  # each item a fixed-length tuple of token ids


class RecGenerateRequest(_Request):
    model: str | None = None
    prompt: Union[str, list[int]]
    catalog: str
    beam_width: int = 16
    top_k: int | None = None  # candidates per beam per step (default: beam_width)
    num_items: int | None = None  # items returned (default: beam_width)
    priority: Literal["online", "offline"] = "online"


class CatalogObject(_Response):
    object: Literal["rec.catalog"] = "rec.catalog"
    name: str
    num_items: int
    item_len: int


class CatalogList(_Response):
    object: Literal["list"] = "list"
    data: list[CatalogObject]


class RecItem(_Response):
    item: list[int]
    score: float  # sum of the item tokens' logprobs given the prompt


class RecUsage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RecGenerateResponse(_Response):
    id: str
    object: Literal["rec.generation"] = "rec.generation"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    catalog: str
    items: list[RecItem]
    usage: RecUsage
