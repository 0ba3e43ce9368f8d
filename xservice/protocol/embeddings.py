"""``/v1/embeddings`` bodies (OpenAI's schema)."""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import Field

from xservice.protocol.base import APIRequest, APIResponse, now

EmbeddingInput = Union[str, list[str], list[int], list[list[int]]]


class EmbeddingRequest(APIRequest):
    """One embedding per input: the final hidden state of its last token, L2-normalised (last-token
    pooling, as decoder embedding models such as Qwen3-Embedding are trained)."""

    ignored_fields: ClassVar[dict[str, str]] = {
        "user": "an end-user id for OpenAI's abuse monitoring; xllm keeps no per-user state",
    }

    input: EmbeddingInput
    model: str | None = None
    # "base64": the little-endian float32 bytes of each vector, base64-encoded (as OpenAI)
    encoding_format: Literal["float", "base64"] = "float"
    # keep the leading dimensions, then renormalise (Matryoshka); at most the model's hidden size
    dimensions: int | None = None
    priority: Literal["online", "offline"] = "online"


class Embedding(APIResponse):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # a str with encoding_format "base64"


class EmbeddingUsage(APIResponse):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(APIResponse):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
