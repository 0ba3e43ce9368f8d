"""``/v1/responses`` bodies: OpenAI's Responses API, stateless.

Nothing is stored: ``store`` (OpenAI's default is true) is accepted and has no effect, and what
needs stored responses (``previous_response_id``, ``conversation``, ``background``, retrieving or
deleting a response) is refused saying so. Input is a string or a list of items: messages (text
and image parts), ``function_call`` and ``function_call_output``; items a client copies from an earlier
response's ``output`` (with their ``id`` / ``status``) are accepted as input.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from xservice.protocol.base import APIRequest, APIResponse, now
from xservice.protocol.request_model import find_unsafe_value
from xservice.protocol.tools import refuse_tool_type, refuse_type

_NOT_STORED = "responses are not stored by this server (every request is stateless)"
_NO_FILES = (
    "this server has no files API for images; send the image in 'image_url' (a data:image/...;base64, "
    "URL, or a file under the server's allowed_local_media_path)"
)
_OUTPUT_ITEM_FIELDS = {
    "id": "the id of an earlier response's output item; input items need none",
    "status": "the status of an earlier response's output item; input items need none",
}


class InputContentPart(APIRequest):
    """A part of an input message: ``input_text`` (or ``output_text`` in an earlier assistant turn), or
    ``input_image`` for vision-language models: ``image_url`` as chat's (a ``data:image/...;base64,``
    URL or an allow-listed local file) and ``detail``; ``file_id`` is refused (no files API).
    Other types (files, audio), and images sent to a text model, are refused by the prompt
    builder, naming the part."""

    model_config = ConfigDict(strict=True, extra="allow")
    ignored_fields: ClassVar[dict[str, str]] = {
        "annotations": "citations of an earlier output text; chat templates have no place for them",
        "logprobs": "logprobs of an earlier output text; they do not shape the prompt",
    }
    unsupported_fields: ClassVar[dict[str, str]] = {"file_id": _NO_FILES}

    type: str
    text: str | None = None
    image_url: str | None = None
    detail: str | None = None  # checked by the prompt builder as chat's, so a 400 names this field


class MessageItem(APIRequest):
    ignored_fields: ClassVar[dict[str, str]] = _OUTPUT_ITEM_FIELDS

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputContentPart]]


class FunctionCallItem(APIRequest):
    """A call the model made earlier (from an earlier response's output)."""

    ignored_fields: ClassVar[dict[str, str]] = _OUTPUT_ITEM_FIELDS

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(APIRequest):
    """The result of a call, for the model to read."""

    ignored_fields: ClassVar[dict[str, str]] = _OUTPUT_ITEM_FIELDS

    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputContentPart]]


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")  # OpenAI's "easy" messages have no type
    return getattr(item, "type", None)


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    ],
    Discriminator(
        _item_type,
        custom_error_type="unsupported_input_item",
        custom_error_message="input item type not supported: use 'message', 'function_call' or "
        "'function_call_output' (reasoning items and item references need stored responses)",
    ),
]


class FunctionTool(APIRequest):
    """A function tool, as the Responses API spells it (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, data: Any) -> Any:
        refuse_tool_type(data)  # web search, file search, computer use, MCP, ...: nothing runs them here
        return data


class NamedFunction(APIRequest):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Union[Literal["none", "auto", "required"], NamedFunction]


class TextFormat(APIRequest):
    """``text.format``: plain text, any JSON object, or JSON following a schema (constrained decoding;
    ``strict`` accepted either way: there is nothing looser to fall back to)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # "schema" clashes with pydantic
    strict: bool | None = None


class TextConfig(APIRequest):
    unsupported_fields: ClassVar[dict[str, str]] = {
        "verbosity": "this server has no verbosity control",
    }

    format: TextFormat | None = None


class ResponsesRequest(APIRequest):
    ignored_fields: ClassVar[dict[str, str]] = {
        "store": "nothing is stored; every request is stateless (OpenAI's default store=true included)",
        "metadata": "tags for OpenAI's stored responses (see 'store')",
        "user": "an end-user id for OpenAI's abuse monitoring; xllm keeps no per-user state",
        "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
        "prompt_cache_key": "OpenAI's cache routing hint; xllm's prefix cache and router need none",
        "service_tier": "OpenAI's processing tiers",
        "stream_options": "its only option (include_obfuscation) adds padding xllm does not send",
    }
    unsupported_fields: ClassVar[dict[str, str]] = {
        "previous_response_id": _NOT_STORED + "; send the whole conversation as 'input'",
        "conversation": _NOT_STORED + "; send the whole conversation as 'input'",
        "background": _NOT_STORED + "; background responses would have to be",
        "prompt": "stored prompt templates are OpenAI's; send 'instructions' and 'input'",
        "reasoning": "this server has no reasoning controls",
        "include": "no extra output data (logprobs, reasoning, tool sources) is available",
        "max_tool_calls": "not supported; use 'parallel_tool_calls': false for at most one call",
        "top_logprobs": "logprobs are not available on /v1/responses; use /v1/chat/completions",
        "truncation": "the context is never truncated; a too long input is a 400",
    }

    model: str | None = None
    input: Union[str, list[InputItem]]
    instructions: str | None = None  # a system message before the input
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's sampling extensions, as on the other generation routes
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, as on chat completions
    text: TextConfig | None = None
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _known_item_types(cls, data: Any) -> Any:
        """An unsupported input item or content part is a 400 at its field (not a union error about
        the whole input); an unsafe value anywhere in the body is reported first, by the field rule."""
        refusal = _first_refusal(data.get("input") if isinstance(data, dict) else None)
        if refusal is not None and find_unsafe_value(data) is None:
            refuse_type(*refusal)
        return data


PART_TYPES = ("input_text", "output_text", "input_image")
_PART_LISTS = {"message": "content", "function_call_output": "output"}  # item type -> its parts' field
Refusal = tuple[Any, tuple[str | int, ...], str]  # ``refuse_type``'s arguments


def _first_refusal(items: Any) -> Refusal | None:
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        kind = _item_type(item)
        if kind not in INPUT_ITEM_TYPES:
            return (
                kind,
                ("input", i, "type"),
                "input item type {kind} is not supported: use 'message', 'function_call' or "
                "'function_call_output' (reasoning items and item references need stored responses)",
            )
        field = _PART_LISTS.get(kind)
        refusal = _part_refusal((i, field), item.get(field)) if field is not None else None
        if refusal is not None:
            return refusal
    return None


def _part_refusal(at: tuple[str | int, ...], parts: Any) -> Refusal | None:
    """A part of an unknown type, a ``file_id``, or an ``input_image`` field that is not a string
    (e.g. chat's ``image_url`` object where Responses takes the URL itself)."""
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        if not isinstance(part, dict):
            continue
        loc = ("input", *at, j)
        kind = part.get("type")
        if kind not in PART_TYPES:
            return (
                kind,
                (*loc, "type"),
                "content part type {kind} is not supported: use 'input_text' or 'input_image' "
                "('output_text' in an earlier assistant turn)",
            )
        if part.get("file_id") is not None:
            return part["file_id"], (*loc, "file_id"), f"not supported: {_NO_FILES}"
        for name in ("image_url", "detail") if kind == "input_image" else ():
            value = part.get(name)
            if value is not None and not isinstance(value, str):
                shape = " (the URL itself, not chat's object)" if name == "image_url" else ""
                return value, (*loc, name), f"'{name}' of an 'input_image' part must be a string{shape}"
    return None


# ---------------------------------------------------------------- response


class OutputText(APIResponse):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(APIResponse):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOutput(APIResponse):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[OutputMessage, FunctionCallOutput]


class InputTokensDetails(APIResponse):
    cached_tokens: int = 0


class OutputTokensDetails(APIResponse):
    reasoning_tokens: int = 0


class ResponseUsage(APIResponse):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(APIResponse):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(APIResponse):
    """A response as OpenAI returns it (``store`` false: this one is not kept)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: None = None
    metadata: dict[str, Any] = {}
