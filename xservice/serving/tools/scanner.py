"""Incremental scanning of one ``{"name": ..., "arguments": {...}}`` call object as its text arrives.

The arguments are streamed as the model writes them: once the text up to the arguments' opening
brace reads ``{"name": "<name>", "arguments": {``, the call starts and every following character
of the arguments object is passed on as it arrives, raw (the arguments string of the call is
exactly what the model wrote). An object of any other shape is parsed whole when it closes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from xservice.serving.tools.base import ArgsDelta, CallStart, ToolEvent

# The common layout; the lookahead needs the arguments' "{" present, so a prefix of the text that
# matches matches the same way in any longer text (streamed and whole outputs split alike).
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([^"\\<]{1,256})"\s*,\s*"arguments"\s*:\s*(?=\{)')


class CallObjectScanner:
    """Feed the text of one JSON object (starting at its ``{``); events come out as soon as known."""

    def __init__(self, start_call: Callable[[str], CallStart]) -> None:
        self._start_call = start_call
        self.text = ""  # the object's text so far
        self.call: CallStart | None = None  # set once the call is known
        self.done = False  # the object closed
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._tried_header = False
        self._args_from = -1  # where the arguments start in ``text`` (fast path)
        self._args_to = -1  # where they end, once closed

    def feed(self, text: str) -> tuple[list[ToolEvent], int]:
        """Events for ``text`` and how many of its characters belong to this object."""
        base = len(self.text)
        self.text += text
        events: list[ToolEvent] = []
        used = len(text)
        for i, ch in enumerate(text):
            pos = base + i
            if self._step(ch, pos, events):
                used = i + 1
                self.text = self.text[: pos + 1]
                break
        if self.call is not None and self._args_from >= 0:
            end = self._args_to if self._args_to >= 0 else len(self.text)
            fragment = self.text[max(self._args_from, base) : end]
            if fragment:
                events.append(ArgsDelta(self.call.index, fragment))
        if self.done and self.call is None:
            events.extend(self._parse_whole())
        return events, used

    def _step(self, ch: str, pos: int, events: list[ToolEvent]) -> bool:
        """Advance over one character; True when it closes the object."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
            if ch == "{" and self._depth == 2 and not self._tried_header:
                self._tried_header = True
                m = _HEADER.match(self.text, 0, pos + 1)
                if m is not None:
                    self.call = self._start_call(m.group(1))
                    events.append(self.call)
                    self._args_from = pos
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1 and self._args_from >= 0 and self._args_to < 0:
                self._args_to = pos + 1
            if self._depth <= 0:
                self.done = True
                return True
        return False

    def _parse_whole(self) -> list[ToolEvent]:
        """A closed object of another layout (e.g. "arguments" first, or a JSON string of arguments)."""
        try:
            obj = json.loads(self.text)
        except ValueError:
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        self.call = self._start_call(obj["name"])
        return [self.call, ArgsDelta(self.call.index, args_text)]
