"""``/tokenize`` and ``/detokenize`` request bodies."""

from __future__ import annotations

from xservice.protocol.base import APIRequest
from xservice.protocol.chat import ChatMessage


class TokenizeRequest(APIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[int]
