"""Prompt inputs (text, token ids, chat messages) → validated token ids.

Texts are tokenized on the app's tokenizer workers (``ctx.text``), never on the event loop when
large; a text that must have more tokens than the model's context is refused before tokenizing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xengine.api.chat_images import place_images
from xservice.http.errors import InvalidRequestError
from xservice.protocol import ChatMessage, ContentPart, PromptInput
from xservice.protocol.tools import MessageToolCall
from xservice.serving.chat_render import ChatRender
from xservice.serving.images import TEMPLATE_IMAGE_PART, ImageRef, image_ref, load_images
from xservice.serving.text_workers import INLINE_MAX_COST

if TYPE_CHECKING:
    from xengine.api.multimodal import ImageInput
    from xengine.api.text.tokenizer import Tokenizer
    from xservice.serving.context import ServingContext
    from xservice.serving.truncation import Truncation


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
    ctx: ServingContext,
    prompt: PromptInput,
    max_prompts: int | None = None,
    *,
    add_special_tokens: bool = True,
    truncation: Truncation | None = None,
) -> list[tuple[str | None, list[int]]]:
    """One ``(text or None, token ids)`` per prompt of a completions request.

    Every cheap check (count, emptiness, the character bound) runs before any text is tokenized.
    With ``truncation`` a long text is no error (it is cut after tokenizing) and a truncated
    prompt's text is None (its ids no longer spell it).
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
            if truncation is None:
                check_text_chars(len(item), ctx.max_model_len, ctx.text.max_token_chars, "prompt")
        else:
            check_token_ids(item, ctx.vocab_size, "prompt")
    texts = [item for item in items if isinstance(item, str)]
    cost = sum(map(len, texts))
    encoded = iter(await ctx.text.run(cost, _encode_all, ctx.tokenizer, texts, add_special_tokens))
    out: list[tuple[str | None, list[int]]] = []
    for item in items:
        text, ids = (item, next(encoded)) if isinstance(item, str) else (None, list(item))
        if not ids:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        if truncation is not None and len(ids) > truncation.max_tokens:
            text, ids = None, truncation.apply(ids)
        out.append((text, ids))
    return out


def _encode_all(tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]


@dataclass(frozen=True)
class MessageParams:
    """Where a request holds its messages, for the 400s that name them: chat's ``messages``, or the
    Responses API's ``input`` (whose items do not map one to one onto the messages)."""

    field: str = "messages"
    contents: Sequence[str] | None = None  # per message, its content's param (None: "<field>.<i>.content")

    def content(self, i: int) -> str:
        return self.contents[i] if self.contents is not None else f"{self.field}.{i}.content"


def _message_dict(
    i: int, msg: ChatMessage, images: list[ImageRef] | None = None, where: MessageParams = MessageParams()
) -> dict[str, Any]:
    """``images``: the model takes images; their parts are appended to it (None: text parts only)."""
    content = msg.content
    if isinstance(content, list) and images is not None:  # parts as HF's processors pass them
        content = _parts_with_images(where.content(i), content, images)
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            at = f"{where.content(i)}.{j}"
            if part.type != "text":
                why = " (it takes no images)" if part.type == "image_url" else " (only 'text' parts are)"
                raise InvalidRequestError(
                    f"Content part type '{part.type}' is not supported by this model{why}.",
                    param=f"{at}.type",
                )
            if part.text is None:
                raise InvalidRequestError("A 'text' content part needs a 'text' field.", param=f"{at}.text")
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": msg.role, "content": content if content is not None else ""}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        if msg.role != "assistant":
            raise InvalidRequestError(
                "Only assistant messages have 'tool_calls'.", param=f"messages.{i}.tool_calls"
            )
        out["tool_calls"] = [_tool_call_dict(call) for call in msg.tool_calls]
    reasoning = _reasoning(i, msg)
    if reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def _parts_with_images(at: str, content: list[ContentPart], images: list[ImageRef]) -> list[dict[str, Any]]:
    """A message's parts (its content at param ``at``) as the template renders them (text and image
    placeholders, in order)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{at}.{j}"
        if part.type == "text":
            if part.text is None:
                raise InvalidRequestError(
                    "A 'text' content part needs a 'text' field.", param=f"{where}.text"
                )
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            images.append(image_ref(part, f"{where}.image_url"))
            parts.append(dict(TEMPLATE_IMAGE_PART))
        else:
            raise InvalidRequestError(
                f"Content part type '{part.type}' is not supported (only 'text' and 'image_url' parts are).",
                param=f"{where}.type",
            )
    return parts


def _reasoning(i: int, msg: ChatMessage) -> str | None:
    """An assistant turn's thinking under either name (vLLM 0.33's ``reasoning``, the older / DeepSeek
    API's ``reasoning_content``); two different texts would leave the template guessing, so they are a 400."""
    for name in ("reasoning", "reasoning_content"):
        if getattr(msg, name) is not None and msg.role != "assistant":
            raise InvalidRequestError(f"Only assistant messages have '{name}'.", param=f"messages.{i}.{name}")
    if None not in (msg.reasoning, msg.reasoning_content) and msg.reasoning != msg.reasoning_content:
        raise InvalidRequestError(
            "'reasoning' and 'reasoning_content' are two names of one field; they must not differ.",
            param=f"messages.{i}.reasoning_content",
        )
    return msg.reasoning if msg.reasoning is not None else msg.reasoning_content


def _tool_call_dict(call: MessageToolCall) -> dict[str, Any]:
    """A call as chat templates expect it: arguments as a mapping (``transformers``' convention) when
    they are a JSON object, else the text as sent."""
    arguments: Any = call.function.arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        arguments = parsed
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def message_dicts(
    messages: list[ChatMessage],
    images: list[ImageRef] | None = None,
    where: MessageParams = MessageParams(),
    start: int = 0,
) -> list[dict[str, Any]]:
    """``messages`` as the dicts a chat template renders (400 naming the part that cannot be, as
    ``where`` locates it; the first of ``messages`` is message ``start`` of the request).

    ``images``: the model takes images; each image part becomes a placeholder part and its reference
    is appended to ``images`` in prompt order (None: image parts are refused).
    """
    return [_message_dict(start + i, m, images, where) for i, m in enumerate(messages)]


@dataclass
class ChatPromptIds:
    ids: list[int]  # image placeholders expanded to their images' pad tokens
    images: list[ImageInput] = field(default_factory=list)  # with their offsets into ``ids``


async def chat_prompt_ids(
    ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True, **kw: Any
) -> list[int]:
    """``chat_prompt``'s token ids (image pads included: the prompt's length as the engine sees it);
    keyword arguments as ``chat_prompt``'s."""
    return (await chat_prompt(ctx, messages, add_generation_prompt, **kw)).ids


async def chat_prompt(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    *,
    add_special_tokens: bool = False,
    truncation: Truncation | None = None,
    render: ChatRender | None = None,
    where: MessageParams = MessageParams(),
) -> ChatPromptIds:
    """Apply the model's chat template to ``messages`` and tokenize the result (off the loop when large);
    with a vision-language model, also load and preprocess the messages' images (off the loop).

    ``add_special_tokens``: the tokenizer's own special tokens on top of the template's;
    ``truncation``: cut the token ids (then a long rendering is no error);
    ``render``: the request's template options (tools, template override, ...);
    ``where``: where the request holds the messages (the params its 400s name).
    """
    if not messages:
        raise InvalidRequestError(f"'{where.field}' must contain at least one message.", param=where.field)
    builder = ctx.images
    refs: list[ImageRef] | None = [] if builder is not None else None
    prompt: list[dict[str, Any]] | list[ChatMessage] = messages  # converted on the worker (no images)
    images: list[ImageInput] = []
    if builder is not None:  # images are loaded before rendering: convert here, to find them
        prompt = message_dicts(messages, refs, where)
        images = await load_images(builder, refs) if refs else []
    ids = await ctx.text.run(
        render_cost(messages, render),
        _render_and_encode,
        ctx.tokenizer,
        prompt,
        add_generation_prompt,
        ctx.max_model_len,
        ctx.text.max_token_chars if truncation is None else None,
        add_special_tokens,
        render,
        where,
    )
    if images:
        assert builder is not None
        try:
            ids, images = place_images(ids, images, builder.image_token_id)
        except ValueError as exc:  # the template dropped or duplicated an image placeholder
            raise InvalidRequestError(
                f"Could not place the images in the prompt: {exc}", param=where.field
            ) from None
        if truncation is not None and len(ids) > truncation.max_tokens:
            raise InvalidRequestError(
                "A prompt with images cannot be truncated (a cut could split an image).",
                param="truncate_prompt_tokens",
            )
        return ChatPromptIds(ids, images)
    return ChatPromptIds(truncation.apply(ids) if truncation is not None else ids)


# Per message, the template work beyond its characters (a loop iteration, role markers); in
# ``TextWorkers.run``'s units (characters), so a long conversation of short messages leaves the loop too.
MESSAGE_COST = 64


def render_cost(messages: list[ChatMessage], render: ChatRender | None) -> int:
    """Cheap estimate of rendering ``messages`` (``TextWorkers.run``'s cost): their text plus a share per
    message and part; tools, documents or a request's own template always count as large work (their
    size is only known by serializing them)."""
    if render is not None and (render.tools or render.documents or render.chat_template):
        return INLINE_MAX_COST + 1
    cost = 0
    for msg in messages:
        content = msg.content
        if isinstance(content, str):
            cost += len(content) + MESSAGE_COST
        elif content is not None:
            cost += MESSAGE_COST * (1 + len(content)) + sum(len(p.text or "") for p in content)
        else:
            cost += MESSAGE_COST
    return cost


def _render_and_encode(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]] | list[ChatMessage],
    add_generation_prompt: bool,
    max_model_len: int,
    max_token_chars: int | None,
    add_special_tokens: bool = False,
    render: ChatRender | None = None,
    where: MessageParams = MessageParams(),
) -> list[int]:
    """``messages`` (``ChatMessage``s, converted here, or their dicts) rendered and tokenized."""
    field = where.field
    dicts = [m if isinstance(m, dict) else _message_dict(i, m, None, where) for i, m in enumerate(messages)]
    try:
        text = (render or ChatRender()).render(tokenizer, dicts, add_generation_prompt)
    except Exception as exc:  # template errors depend on the request (roles, order), so they are 400s
        raise InvalidRequestError(f"Could not apply the chat template: {exc}", param=field) from None
    # The bound is checked on the rendered text, not the message contents: a template may drop
    # parts of the contents (e.g. earlier turns' reasoning), so only the rendered length is certain.
    check_text_chars(len(text), max_model_len, max_token_chars, field)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise InvalidRequestError(f"The chat template renders '{field}' as an empty prompt.", param=field)
    return ids
