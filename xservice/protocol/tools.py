"""Tool (function) calling bodies shared by ``/v1/chat/completions`` and ``/v1/responses``.

Requests: tool definitions, ``tool_choice`` and the assistant ``tool_calls`` of a conversation's
history. Responses: the parsed calls, whole (``message.tool_calls``) or as stream deltas
(``delta.tool_calls[i]``: ``index`` always, ``id`` / ``type`` / ``function.name`` on a call's first
delta, then ``function.arguments`` fragments), in OpenAI's shape.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import SerializerFunctionWrapHandler, ValidationError, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from xservice.protocol.base import APIRequest, APIResponse


class FunctionDefinition(APIRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; omitted: no parameters
    strict: bool | None = None  # true: arguments must follow ``parameters`` exactly (constrained decoding)


def refuse_type(kind: Any, loc: tuple[str | int, ...], message: str) -> None:
    """Raise a validation error (a 400) at ``loc``: ``message``, whose ``{kind}`` is the refused type."""
    error = PydanticCustomError("unsupported_type", "{message}", {"message": message.format(kind=repr(kind))})
    raise ValidationError.from_exception_data("type", [InitErrorDetails(type=error, loc=loc, input=kind)])


def refuse_tool_type(data: Any, supported: str = "function") -> None:
    """A 400 at ``type`` for tools of other types (checked before their other fields, which differ)."""
    if isinstance(data, dict) and data.get("type") != supported:
        message = f"tool type {{kind}} is not supported; only '{supported}' tools are (nothing here runs other tools)"
        refuse_type(data.get("type"), ("type",), message)


class ChatTool(APIRequest):
    type: Literal["function"]  # OpenAI's built-in and custom tool types have nothing to run them here
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, data: Any) -> Any:
        refuse_tool_type(data)
        return data


class ToolChoiceFunction(APIRequest):
    name: str


class NamedToolChoice(APIRequest):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class MessageToolCallFunction(APIRequest):
    name: str
    arguments: str  # JSON text, as the model produced it


class MessageToolCall(APIRequest):
    """A call made by an earlier assistant turn (in ``messages``)."""

    id: str
    type: Literal["function"]
    function: MessageToolCallFunction


class ToolCallFunction(APIResponse):
    name: str
    arguments: str


class ToolCall(APIResponse):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _WithoutNulls(APIResponse):
    """Leaves unset (None) fields out of the JSON, as OpenAI's stream deltas do."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None
