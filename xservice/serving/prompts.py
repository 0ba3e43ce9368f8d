"""Prompt inputs (text, token ids, chat messages) → validated token ids."""

from __future__ import annotations

from typing import Any

from xservice.errors import InvalidRequestError
from xservice.protocol import ChatMessage, PromptInput


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 when any id is outside ``[0, vocab_size)``."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"Token id {t} at position {i} is out of vocabulary (valid ids: 0..{vocab_size - 1}).",
                param=param,
            )


def completion_prompts(
    tokenizer: Any, prompt: PromptInput, vocab_size: int
) -> list[tuple[str | None, list[int]]]:
    """One ``(text or None, token ids)`` per prompt of a completions request."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise InvalidRequestError("The prompt must not be empty.", param="prompt")
    out: list[tuple[str | None, list[int]]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError("The prompt must not be empty.", param="prompt")
            ids = tokenizer.encode(item, add_special_tokens=True)
            text: str | None = item
        else:
            ids, text = list(item), None
            check_token_ids(ids, vocab_size, "prompt")
        if not ids:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        out.append((text, ids))
    return out


def _message_dict(i: int, msg: ChatMessage) -> dict[str, Any]:
    content = msg.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise InvalidRequestError(
                    f"Content part type '{part.type}' is not supported by this model (only 'text' parts are).",
                    param=f"messages.{i}.content.{j}.type",
                )
            if part.text is None:
                raise InvalidRequestError(
                    "A 'text' content part needs a 'text' field.", param=f"messages.{i}.content.{j}.text"
                )
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": msg.role, "content": content if content is not None else ""}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    return out


def chat_prompt_ids(
    tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Apply the model's chat template to ``messages`` and tokenize the result."""
    if not messages:
        raise InvalidRequestError("'messages' must contain at least one message.", param="messages")
    dicts = [_message_dict(i, m) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # template errors depend on the request (roles, order), so they are 400s
        raise InvalidRequestError(f"Could not apply the chat template: {exc}", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequestError("The messages produce an empty prompt.", param="messages")
    return ids
