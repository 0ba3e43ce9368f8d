"""Calls written as a JSON array ``[{"name": ..., "arguments": {...}}, ...]``: the output of
``tool_choice`` "required" or a named tool, whose decoding is constrained to that array
(``constraint.forced_calls_schema``), whatever the model family's own call syntax.

Text that does not fit the array (possible only without the constraint) is passed on as content.
"""

from __future__ import annotations

from xservice.serving.tools.base import BaseToolParser, TextDelta, ToolEvent
from xservice.serving.tools.scanner import CallObjectScanner


class JsonArrayToolParser(BaseToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._state = "start"  # start (before "[") | between (calls) | object | end (after "]") | text
        self._scanner: CallObjectScanner | None = None

    def _feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while text:
            if self._state == "text":
                events.append(TextDelta(text))
                break
            if self._state == "object":
                text = self._in_object(text, events)
                continue
            body = text.lstrip()
            if not body:
                break
            text = self._punctuation(body)
        return events

    def _punctuation(self, text: str) -> str:
        """Consume the array's syntax around the call objects (``text`` starts with non-whitespace)."""
        ch = text[0]
        if self._state == "start" and ch == "[":
            self._state = "between"
        elif self._state == "between" and ch == ",":
            pass
        elif self._state == "between" and ch == "]":
            self._state = "end"
        elif self._state == "between" and ch == "{":
            self._scanner = CallObjectScanner(self._start_call)
            self._state = "object"
            return text
        else:
            self._state = "text"
            return text
        return text[1:]

    def _in_object(self, text: str, events: list[ToolEvent]) -> str:
        assert self._scanner is not None
        found, used = self._scanner.feed(text)
        events.extend(found)
        if self._scanner.done:
            if self._scanner.call is None:  # an element that is no call: content from here on
                events.append(TextDelta(self._scanner.text))
                self._state = "text"
            else:
                self._state = "between"
            self._scanner = None
        return text[used:]

    def _finish(self) -> list[ToolEvent]:
        scanner, self._scanner = self._scanner, None
        if scanner is not None and scanner.call is None and scanner.text:
            return [TextDelta(scanner.text)]
        return []
