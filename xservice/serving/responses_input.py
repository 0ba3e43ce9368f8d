"""A Responses API request → chat messages, tool definitions and the output constraint.

``instructions`` become a system message; input messages keep their role; ``function_call`` items
become assistant ``tool_calls`` (consecutive calls, and an assistant text right before them, form
one assistant turn, as they came from one response) and ``function_call_output`` items become
``tool`` messages. The prompt is then rendered as a chat request's would be.
"""

from __future__ import annotations

import json
from typing import Any

from xengine.api.grammar import check_spec, grammar_spec
from xengine.api.messages import StructuredOutputsParams
from xservice.errors import InvalidRequestError
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

_TEXT_PARTS = ("input_text", "output_text")


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
        if part.text is None:
            raise InvalidRequestError("A text content part needs a 'text' field.", param=f"{where}.{j}.text")
        texts.append(part.text)
    return "\n".join(texts)


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The conversation of ``body`` as chat messages (400 naming the item that cannot be one)."""
    out: list[dict[str, Any]] = []
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content, f"input.{i}.content")})
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
        elif isinstance(item, FunctionCallOutputItem):
            content = _text(item.output, f"input.{i}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
    if not out or all(m["role"] == "system" for m in out):
        raise InvalidRequestError("'input' must contain at least one item.", param="input")
    return [ChatMessage.model_validate(m) for m in out]


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
