"""The Responses API's output: the event sequence of a streamed response, and the response it adds up to.

Output text goes through the request's tool parser (when it has tools); content opens a message
item, a call a ``function_call`` item, each closed when the next begins or the output ends:

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
        response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta ...,
        response.function_call_arguments.done, response.output_item.done, ...,
    response.completed (or response.incomplete when max_output_tokens cut it off)

A non-streamed response is built by the same builder fed the whole text, so both agree.
"""

from __future__ import annotations

import uuid
from typing import Any

from xservice.protocol import dump
from xservice.protocol.responses import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
)
from xservice.serving.tools.base import BaseToolParser, CallStart, TextDelta, ToolEvent

Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Feed output text with ``text``, end with ``finish``; each returns the events to stream."""

    def __init__(self, response: ResponseObject, parser: BaseToolParser | None) -> None:
        self.response = response  # status in_progress, output empty; completed in place
        self.parser = parser
        self._seq = 0
        self._open: OutputMessage | FunctionCallOutput | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return dump(self.response)

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def text(self, text: str) -> list[Event]:
        events = self.parser.feed(text) if self.parser is not None else [TextDelta(text)] if text else []
        return [e for event in events for e in self._apply(event)]

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[Event]:
        out = [e for event in (self.parser.finish() if self.parser else []) for e in self._apply(event)]
        incomplete = finish_reason == "length"
        if not self.response.output:  # no text at all: still one (empty) message
            out += self._open_message()
        out += self._close("incomplete" if incomplete else "completed")
        self.response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        self.response.usage = usage
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*out, self._event(kind, response=self._snapshot())]

    def _apply(self, event: ToolEvent) -> list[Event]:
        out: list[Event] = []
        if isinstance(event, TextDelta):
            if not isinstance(self._open, OutputMessage):
                out += self._close("completed") + self._open_message()
            assert isinstance(self._open, OutputMessage)
            self._open.content[0].text += event.text
            out.append(
                self._event("response.output_text.delta", **self._where(), delta=event.text, logprobs=[])
            )
        elif isinstance(event, CallStart):
            out += self._close("completed")
            item = FunctionCallOutput(
                id=_item_id("fc"), call_id=event.call_id, name=event.name, arguments="", status="in_progress"
            )
            out += self._add(item)
        elif isinstance(self._open, FunctionCallOutput):
            self._open.arguments += event.text
            out.append(
                self._event("response.function_call_arguments.delta", **self._where(False), delta=event.text)
            )
        return out

    def _where(self, with_content: bool = True) -> dict[str, Any]:
        assert self._open is not None
        where: dict[str, Any] = {"item_id": self._open.id, "output_index": len(self.response.output) - 1}
        if with_content:
            where["content_index"] = 0
        return where

    def _add(self, item: OutputMessage | FunctionCallOutput) -> list[Event]:
        self.response.output.append(item)
        self._open = item
        return [
            self._event(
                "response.output_item.added", output_index=len(self.response.output) - 1, item=dump(item)
            )
        ]

    def _open_message(self) -> list[Event]:
        message = OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
        out = self._add(message)
        message.content.append(OutputText(text=""))
        part = dump(OutputText(text=""))
        return [*out, self._event("response.content_part.added", **self._where(), part=part)]

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": len(self.response.output) - 1}
        item.status = status  # type: ignore[assignment]
        if isinstance(item, OutputMessage):
            part = item.content[0]
            out = [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=part.text, logprobs=[]
                ),
                self._event("response.content_part.done", **where, content_index=0, part=dump(part)),
            ]
        else:
            out = [
                self._event(
                    "response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments
                )
            ]
        return [
            *out,
            self._event("response.output_item.done", output_index=where["output_index"], item=dump(item)),
        ]


def usage_of(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
        output_tokens=output_tokens,
        total_tokens=prompt_tokens + output_tokens,
    )
