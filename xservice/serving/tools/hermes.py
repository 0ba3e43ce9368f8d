"""Hermes-style calls (Qwen2.5, Qwen3, Hermes, ...): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.

Text outside the tags is content; whitespace right before a ``<tool_call>`` and right after a
``</tool_call>`` is dropped (it separates calls, it is not content). A block whose body is no call
object (invalid JSON, no name) is returned as content, tags included, so nothing the model wrote
is lost. A block cut off by the end of the output is a call if its name was already known (its
arguments are then incomplete, as OpenAI's are when ``finish_reason`` is ``length``).
"""

from __future__ import annotations

from xservice.serving.tools.base import BaseToolParser, TextDelta, ToolEvent
from xservice.serving.tools.scanner import CallObjectScanner

START, END = "<tool_call>", "</tool_call>"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolParser(BaseToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._state = "text"  # text | pre (after <tool_call>) | object | post (after the object) | raw
        self._pending = ""  # text held back: a possible tag start, or whitespace before one
        self._block = ""  # the current block's text from <tool_call>, for when it is no call
        self._scanner: CallObjectScanner | None = None
        self._after_call = False  # drop whitespace that follows a call

    def _feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        handlers = {
            "text": self._in_text,
            "pre": self._in_pre,
            "object": self._in_object,
            "post": self._until_end,
            "raw": self._until_end,
        }
        while text:
            text = handlers[self._state](text, events)
        return events

    def _finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        rest, self._pending = self._pending, ""
        if self._state == "text":
            self._emit(rest, events)
        elif self._scanner is None or self._scanner.call is None:  # an unfinished block without a call
            self._emit(self._block + rest, events)
        self._state = "text"
        return events

    def _emit(self, text: str, events: list[ToolEvent], before_call: bool = False) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if before_call:
            text = text.rstrip()
        if text:
            events.append(TextDelta(text))

    def _in_text(self, text: str, events: list[ToolEvent]) -> str:
        s, self._pending = self._pending + text, ""
        at = s.find(START)
        if at >= 0:
            self._emit(s[:at], events, before_call=True)
            self._state, self._block = "pre", START
            return s[at + len(START) :]
        keep = partial_suffix(s, START)
        body = s[: len(s) - keep]
        shown = body.rstrip()  # trailing whitespace waits: it is dropped if a call follows
        self._emit(shown, events)
        self._pending = body[len(shown) :] + s[len(s) - keep :]
        return ""

    def _in_pre(self, text: str, events: list[ToolEvent]) -> str:
        body = text.lstrip()
        self._block += text[: len(text) - len(body)]
        if not body:
            return ""
        if body[0] == "{":
            self._scanner = CallObjectScanner(self._start_call)
            self._state = "object"
        else:
            self._state = "raw"
        return body

    def _in_object(self, text: str, events: list[ToolEvent]) -> str:
        assert self._scanner is not None
        found, used = self._scanner.feed(text)
        events.extend(found)
        self._block += text[:used]
        if self._scanner.done:
            self._state = "post"
        return text[used:]

    def _until_end(self, text: str, events: list[ToolEvent]) -> str:
        s, self._pending = self._pending + text, ""
        at = s.find(END)
        if at < 0:
            keep = partial_suffix(s, END)
            self._block += s[: len(s) - keep]
            self._pending = s[len(s) - keep :]
            return ""
        self._block += s[: at + len(END)]
        if self._scanner is not None and self._scanner.call is not None:
            self._after_call = True
        else:
            self._emit(self._block, events)
        self._state, self._block, self._scanner = "text", "", None
        return s[at + len(END) :]
