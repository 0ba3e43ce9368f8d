"""The tool-call parser interface: model output text in, ordered content / call events out.

A parser is fed the output text of one choice as it is generated (``feed``) and flushed at the
end (``finish``). It returns events in output order: ``TextDelta`` (content for the user),
``CallStart`` (a call's id and function name, once known) and ``ArgsDelta`` (a fragment of that
call's arguments, JSON text). The whole output parsed in one ``feed`` gives the same calls and
content as any split of it into pieces: non-streaming responses are the streamed events added up
(``collect``), so the two cannot disagree.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # position of the call among this output's calls
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


ToolEvent = Union[TextDelta, CallStart, ArgsDelta]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class BaseToolParser(ABC):
    """Turns one output's text into content and tool-call events (one instance per choice)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # ``parallel_tool_calls: false``: calls past the first are dropped
        self._num_calls = 0  # calls started so far, kept or not

    def feed(self, text: str) -> list[ToolEvent]:
        """Events for ``text`` appended to the output (text that may start a call is held back)."""
        return self._limit(self._feed(text)) if text else []

    def finish(self) -> list[ToolEvent]:
        """Events for whatever is held back, at the end of the output."""
        return self._limit(self._finish())

    @abstractmethod
    def _feed(self, text: str) -> list[ToolEvent]: ...

    @abstractmethod
    def _finish(self) -> list[ToolEvent]: ...

    def _start_call(self, name: str) -> CallStart:
        start = CallStart(self._num_calls, new_call_id(), name)
        self._num_calls += 1
        return start

    def _limit(self, events: list[ToolEvent]) -> list[ToolEvent]:
        if self.max_calls is None:
            return events
        return [e for e in events if isinstance(e, TextDelta) or e.index < self.max_calls]


@dataclass
class ParsedCall:
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class ParsedOutput:
    """Events added up: the content (None when empty) and the calls in order."""

    content: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)

    def add(self, events: list[ToolEvent]) -> None:
        for event in events:
            if isinstance(event, TextDelta):
                self.content = (self.content or "") + event.text
            elif isinstance(event, CallStart):
                self.calls.append(ParsedCall(event.call_id, event.name))
            else:
                self.calls[event.index].arguments += event.text


def collect(parser: BaseToolParser, text: str) -> ParsedOutput:
    """Parse a whole output at once."""
    out = ParsedOutput()
    out.add(parser.feed(text))
    out.add(parser.finish())
    return out
