"""A Responses API request → chat messages, tool definitions and the output constraint.

``instructions`` become a system message; input messages keep their role; ``function_call`` items
become assistant ``tool_calls`` (consecutive calls, and an assistant text right before them, form
one assistant turn, as they came from one response) and ``function_call_output`` items become
``tool`` messages. ``input_image`` parts become chat ``image_url`` parts, so the images take chat's
path (``serving/images.py``: same limits, errors and image tokens), with every 400 naming the part
of ``input`` it came from. The prompt is then rendered as a chat request's would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from xengine.api.grammar import check_spec, grammar_spec
from xengine.api.messages import StructuredOutputsParams
from xservice.http.errors import InvalidRequestError
from xservice.protocol import ChatMessage
from xservice.protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContentPart,
    MessageItem,
    ResponsesRequest,
    TextConfig,
)
from xservice.protocol.tools import FunctionDefinition, NamedToolChoice, ToolChoice
from xservice.serving.images import check_detail
from xservice.serving.prompts import MessageParams

_TEXT_PARTS = ("input_text", "output_text")
IMAGE_PART = "input_image"
_IMAGE_FIELDS = ("image_url", "detail")


@dataclass
class InputConversation:
    """A Responses request's conversation as chat messages, and where each message's content is in
    the request (for the 400s of chat's prompt builder)."""

    messages: list[ChatMessage]
    where: MessageParams


def responses_param(i: int, field: str) -> str:
    """Where field ``field`` of tool ``i`` is in a Responses request (tools are flat there)."""
    return f"tools.{i}" if field == "type" else f"tools.{i}.{field}"


def _text(content: str | list[InputContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise InvalidRequestError(
                f"Content part type '{part.type}' is not supported by this model (only text parts are).",
                param=f"{where}.{j}.type",
            )
        texts.append(_text_of(part, f"{where}.{j}"))
    return "\n".join(texts)


def _text_of(part: InputContentPart, at: str) -> str:
    for name in _IMAGE_FIELDS:
        if getattr(part, name) is not None:
            raise InvalidRequestError(f"A text content part has no '{name}'.", param=f"{at}.{name}")
    if part.text is None:
        raise InvalidRequestError("A text content part needs a 'text' field.", param=f"{at}.text")
    return part.text


def _image_part(part: InputContentPart, at: str) -> dict[str, Any]:
    """An ``input_image`` part as chat's ``image_url`` part (its URL is checked and loaded there;
    ``file_id`` is refused by the protocol)."""
    if part.image_url is None:
        raise InvalidRequestError(
            "An 'input_image' content part needs an 'image_url'.", param=f"{at}.image_url"
        )
    if part.text is not None:
        raise InvalidRequestError("An 'input_image' content part has no 'text'.", param=f"{at}.text")
    check_detail(part.detail, f"{at}.detail")
    return {"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}}


def _content(content: str | list[InputContentPart], where: str, takes_images: bool) -> Any:
    """A message's content: its text, or (when it holds images) chat content parts in order."""
    if isinstance(content, str) or all(p.type != IMAGE_PART for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        if part.type == IMAGE_PART and takes_images:
            parts.append(_image_part(part, at))
        elif part.type in _TEXT_PARTS:
            parts.append({"type": "text", "text": _text_of(part, at)})
        else:
            why = "it takes no images" if part.type == IMAGE_PART else "only text and 'input_image' parts are"
            raise InvalidRequestError(
                f"Content part type '{part.type}' is not supported by this model ({why}).", param=f"{at}.type"
            )
    return parts


def input_messages(body: ResponsesRequest, takes_images: bool = False) -> InputConversation:
    """The conversation of ``body`` as chat messages (400 naming the item that cannot be one);
    ``takes_images``: the model is a vision-language model (else image parts are refused)."""
    out: list[dict[str, Any]] = []
    contents: list[str] = []  # per message: where its content is in the request
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
        contents.append("instructions")
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        where = "input" if isinstance(body.input, str) else f"input.{i}.content"
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _content(item.content, where, takes_images)})
            contents.append(where)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                contents.append(f"input.{i}")
        elif isinstance(item, FunctionCallOutputItem):
            content = _text(item.output, f"input.{i}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
            contents.append(f"input.{i}.output")
    if not out or all(m["role"] == "system" for m in out):
        raise InvalidRequestError("'input' must contain at least one item.", param="input")
    messages = [ChatMessage.model_validate(m) for m in out]
    return InputConversation(messages, MessageParams("input", contents))


def functions_of(body: ResponsesRequest) -> list[FunctionDefinition]:
    return [
        FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)
        for t in body.tools or []
    ]


def tool_choice_of(body: ResponsesRequest) -> ToolChoice | None:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": choice.name}})


def text_constraint(text: TextConfig | None) -> StructuredOutputsParams | None:
    """The constraint of ``text.format`` (None for plain text); 400 naming it when it cannot compile."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.schema_ is None:
        raise InvalidRequestError("'json_schema' needs a 'schema'.", param="text.format.schema")
    params = StructuredOutputsParams(json=json.dumps(fmt.schema_, ensure_ascii=False))
    try:
        params.validate()
        check_spec(grammar_spec(params))
    except ValueError as exc:
        reason = str(exc).removeprefix("invalid value for 'structured_outputs': ")
        raise InvalidRequestError(f"Invalid JSON schema: {reason}", param="text.format.schema") from None
    return params
