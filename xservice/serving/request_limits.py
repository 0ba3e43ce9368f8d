"""Cheap counts of a decoded request body, checked before it is validated.

Validating a body costs time per element (the field rule is Python, once per message, part and tool), so
a legal-size body of 100k content parts took over a second to refuse. These counts touch only the lists'
lengths (and each message's content list), so a body with more of something than the service accepts is
refused with a 400 naming the field and the limit before any of that work. Limits that already exist
further in (tools, ``logit_bias``, stop strings, bad words, choices) are the same numbers, checked earlier;
messages and content parts have their own settings (``service.max_messages``, ``service.max_content_parts``).

Field names mean the same on every route that has them, so one walk serves every JSON body: ``messages``
(chat, ``/tokenize``; a list of conversations on ``/v1/chat/completions/batch``), the Responses API's
``input`` items, ``tools``, ``logit_bias``, ``stop``, ``bad_words``, ``guided_choice`` and
``structured_outputs.choice``. A value of the wrong type is left to validation, which names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xengine.api.constraints import MAX_BAD_WORDS, MAX_CHOICES, MAX_LOGIT_BIAS_ENTRIES
from xengine.api.sampling_params import MAX_STOP_STRINGS
from xservice.http.errors import InvalidRequestError
from xservice.serving.tools.plan import MAX_TOOLS

TOO_MANY = "array_above_max_length"  # OpenAI's code for a list longer than it accepts

# field -> (limit, what it counts) for the flat lists and maps
_FLAT_LIMITS: dict[str, tuple[int, str]] = {
    "tools": (MAX_TOOLS, "tools"),
    "logit_bias": (MAX_LOGIT_BIAS_ENTRIES, "logit_bias entries"),
    "stop": (MAX_STOP_STRINGS, "stop strings"),
    "bad_words": (MAX_BAD_WORDS, "bad words"),
    "guided_choice": (MAX_CHOICES, "choices"),
}
# Responses API input item type -> the field holding its parts
_ITEM_PARTS = {"message": "content", "function_call_output": "output"}


@dataclass(frozen=True)
class RequestLimits:
    """The configured counts (``ServiceConfig.max_messages`` / ``max_content_parts``)."""

    max_messages: int
    max_content_parts: int


def check_counts(body: Any, limits: RequestLimits) -> None:
    """400 naming the field (and the limit) when ``body`` holds more of something than is accepted.

    Work is proportional to the number of messages, not to their contents.
    """
    if not isinstance(body, dict):
        return
    for name, (limit, what) in _FLAT_LIMITS.items():
        _check_len(body.get(name), limit, what, name)
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        _check_len(structured.get("choice"), MAX_CHOICES, "choices", "structured_outputs.choice")
    messages = body.get("messages")
    if isinstance(messages, list):
        _check_messages(messages, limits)
    items = body.get("input")
    if isinstance(items, list) and items and isinstance(items[0], dict):  # Responses API items
        _check_input_items(items, limits)


def _check_len(value: Any, limit: int, what: str, param: str) -> None:
    if isinstance(value, list | dict) and len(value) > limit:
        raise InvalidRequestError(
            f"At most {limit} {what} per request, got {len(value)}.", param=param, code=TOO_MANY
        )


def _check_messages(messages: list[Any], limits: RequestLimits) -> None:
    """Chat messages, or (the batch endpoint) a list of conversations, each a list of messages."""
    _check_total(len(messages), limits.max_messages, "messages", "messages", "max_messages")
    located: list[tuple[str, Any]] = []
    for i, entry in enumerate(messages):
        if isinstance(entry, list):
            _check_total(
                len(located) + len(entry), limits.max_messages, "messages", "messages", "max_messages"
            )
            located.extend((f"messages.{i}.{j}", msg) for j, msg in enumerate(entry))
        else:
            located.append((f"messages.{i}", entry))
    num_parts = 0
    for where, msg in located:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            num_parts += len(content)
            _check_total(
                num_parts, limits.max_content_parts, "content parts", f"{where}.content", "max_content_parts"
            )


def _check_input_items(items: list[Any], limits: RequestLimits) -> None:
    _check_total(len(items), limits.max_messages, "input items", "input", "max_messages")
    num_parts = 0
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")  # a message item may leave its type out
        field = _ITEM_PARTS.get(kind) if isinstance(kind, str) else None  # any other type: a 400 later
        parts = item.get(field) if field else None
        if isinstance(parts, list):
            num_parts += len(parts)
            _check_total(
                num_parts,
                limits.max_content_parts,
                "content parts",
                f"input.{i}.{field}",
                "max_content_parts",
            )


def _check_total(count: int, limit: int, what: str, param: str, setting: str) -> None:
    if count > limit:
        raise InvalidRequestError(
            f"At most {limit} {what} per request (service.{setting}); this request has more.",
            param=param,
            code=TOO_MANY,
        )
