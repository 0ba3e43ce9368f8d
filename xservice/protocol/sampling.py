"""Fields shared by ``/v1/completions`` and ``/v1/chat/completions``: sampling, stopping, streaming.

vLLM-style sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, ...) and ``priority`` are
accepted on both endpoints.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Union

from xservice.protocol.base import IGNORED_FIELDS, UNSUPPORTED_FIELDS, APIRequest


class StreamOptions(APIRequest):
    ignored_fields: ClassVar[dict[str, str]] = {
        "include_obfuscation": "xllm adds no obfuscation padding to stream events",
    }
    unsupported_fields: ClassVar[dict[str, str]] = {
        "continuous_usage_stats": "not implemented yet",
    }

    include_usage: bool = False


class SamplingRequest(APIRequest):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    ignored_fields: ClassVar[dict[str, str]] = IGNORED_FIELDS
    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

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
    priority: Literal["online", "offline"] = "online"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)
