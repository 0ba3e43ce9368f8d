"""``/tokenize`` and ``/detokenize`` request bodies."""

from __future__ import annotations

from typing import Any

from xservice.protocol.base import APIRequest
from xservice.protocol.chat import ChatMessage
from xservice.protocol.tools import ChatTool


class TokenizeRequest(APIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    # with ``messages``: the chat template's inputs beyond the messages, as on /v1/chat/completions
    tools: list[ChatTool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    continue_final_message: bool = False
    return_token_strs: bool = False  # the tokens as the tokenizer's strings too ('token_strs')


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[int]
