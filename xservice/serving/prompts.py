"""Prompt inputs (text, token ids, chat messages) → validated token ids.

Texts are tokenized on the app's tokenizer workers (``ctx.text``), never on the event loop when
large; a text that must have more tokens than the model's context is refused before tokenizing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xservice.errors import InvalidRequestError
from xservice.protocol import ChatMessage, PromptInput

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer
    from xservice.serving.context import ServingContext


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 when any id is outside ``[0, vocab_size)``."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"Token id {t} at position {i} is out of vocabulary (valid ids: 0..{vocab_size - 1}).",
                param=param,
            )


def check_text_chars(num_chars: int, max_model_len: int, max_token_chars: int | None, where: str) -> None:
    """400 (without tokenizing) when a text of ``num_chars`` characters must exceed ``max_model_len`` tokens.

    Sound, not tight: no token covers more than ``max_token_chars`` characters, so a longer text has
    more tokens than ``max_model_len``; shorter texts are left to the token count. ``where`` names
    the field ("prompt" or "messages").
    """
    if max_token_chars is None:
        return
    max_chars = max_model_len * max_token_chars
    if num_chars > max_chars:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, the {where} has "
            f"{num_chars} characters, more than {max_model_len} tokens can hold ({max_chars} characters: no "
            f"token of this model covers more than {max_token_chars}). Please reduce the length of the {where}.",
            param=where,
            code="context_length_exceeded",
        )


def _prompt_items(prompt: PromptInput) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def completion_prompts(
    ctx: ServingContext, prompt: PromptInput, max_prompts: int | None = None
) -> list[tuple[str | None, list[int]]]:
    """One ``(text or None, token ids)`` per prompt of a completions request.

    Every cheap check (count, emptiness, the character bound) runs before any text is tokenized.
    """
    items = _prompt_items(prompt)
    if not items:
        raise InvalidRequestError("The prompt must not be empty.", param="prompt")
    if max_prompts is not None and len(items) > max_prompts:
        raise InvalidRequestError(
            f"At most {max_prompts} prompts per request, got {len(items)}.", param="prompt"
        )
    for item in items:
        if not item:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        if isinstance(item, str):
            check_text_chars(len(item), ctx.max_model_len, ctx.text.max_token_chars, "prompt")
        else:
            check_token_ids(item, ctx.vocab_size, "prompt")
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(await ctx.text.run(sum(map(len, texts)), _encode_all, ctx.tokenizer, texts))
    out: list[tuple[str | None, list[int]]] = []
    for item in items:
        if isinstance(item, str):
            ids = next(encoded)
            if not ids:
                raise InvalidRequestError("The prompt must not be empty.", param="prompt")
            out.append((item, ids))
        else:
            out.append((None, list(item)))
    return out


def _encode_all(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=True) for text in texts]


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


async def chat_prompt_ids(
    ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Apply the model's chat template to ``messages`` and tokenize the result (off the loop when large)."""
    if not messages:
        raise InvalidRequestError("'messages' must contain at least one message.", param="messages")
    dicts = [_message_dict(i, m) for i, m in enumerate(messages)]
    num_chars = sum(len(d["content"]) for d in dicts)
    return await ctx.text.run(
        num_chars,
        _render_and_encode,
        ctx.tokenizer,
        dicts,
        add_generation_prompt,
        ctx.max_model_len,
        ctx.text.max_token_chars,
    )


def _render_and_encode(
    tokenizer: Tokenizer,
    dicts: list[dict[str, Any]],
    add_generation_prompt: bool,
    max_model_len: int,
    max_token_chars: int | None,
) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # template errors depend on the request (roles, order), so they are 400s
        raise InvalidRequestError(f"Could not apply the chat template: {exc}", param="messages") from None
    # The bound is checked on the rendered text, not the message contents: a template may drop
    # parts of the contents (e.g. earlier turns' reasoning), so only the rendered length is certain.
    check_text_chars(len(text), max_model_len, max_token_chars, "messages")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequestError("The messages produce an empty prompt.", param="messages")
    return ids
