"""Incremental split of a thinking model's output into reasoning and content.

The output starts inside reasoning (templates of these models open ``<think>`` in the prompt, or
the model writes it first, and then it is dropped) until the end tag; the rest is content. Text that
may be the start of a tag is held back until the next delta decides, so a tag split across deltas
never leaks into either part, and a stream's pieces add up to the whole output's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Part = Literal["reasoning", "content"]


@dataclass(frozen=True)
class ThinkTags:
    """The tags of one family, and what each state does with them."""

    start: str = "<think>"
    end: str = "</think>"
    # text that ends reasoning implicitly and stays in the content (e.g. a tool call opened while thinking)
    implicit_ends: tuple[str, ...] = ()
    drop_extra_ends: bool = False  # an end tag written again inside the content is dropped


class ThinkSplitter:
    """Feed text deltas; get ``(part, text)`` pieces in output order."""

    def __init__(self, tags: ThinkTags, thinking: bool = True) -> None:
        self.tags = tags
        self.part: Part = "reasoning" if thinking else "content"
        self._held = ""  # text that may still start a tag
        self.ended = not thinking  # reasoning ended (or never was)
        self._thinking = thinking  # without thinking the output is content, verbatim

    def _markers(self) -> tuple[str, ...]:
        t = self.tags
        if self.part == "reasoning":
            return (t.start, t.end, *t.implicit_ends)
        return (t.end,) if t.drop_extra_ends and self._thinking else ()

    def feed(self, text: str) -> list[tuple[Part, str]]:
        pieces: list[tuple[Part, str]] = []
        buf = self._held + text
        self._held = ""
        while buf:
            markers = self._markers()
            hit = _first(buf, markers)
            if hit is None:
                keep = _tag_prefix_len(buf, markers)
                _add(pieces, self.part, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            pos, marker = hit
            _add(pieces, self.part, buf[:pos])
            buf = buf[pos + len(marker) :]
            if self.part == "reasoning" and marker == self.tags.end:
                self.part, self.ended = "content", True
            elif self.part == "reasoning" and marker in self.tags.implicit_ends:
                self.part, self.ended = "content", True
                _add(pieces, "content", marker)  # the implicit end belongs to the content
            # otherwise: a start tag inside reasoning, or an extra end tag in content: dropped
        return pieces

    def finish(self) -> list[tuple[Part, str]]:
        """The held-back text, in the current part (the output ended mid-way into no tag)."""
        pieces: list[tuple[Part, str]] = []
        _add(pieces, self.part, self._held)
        self._held = ""
        return pieces


def split_whole(tags: ThinkTags, thinking: bool, text: str) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole output; an empty part is None."""
    splitter = ThinkSplitter(tags, thinking)
    parts = {"reasoning": "", "content": ""}
    for part, piece in splitter.feed(text) + splitter.finish():
        parts[part] += piece
    return parts["reasoning"] or None, parts["content"] or None


def reasoning_span(tags: ThinkTags, thinking: bool, text: str) -> tuple[int, int]:
    """Character span ``[start, end)`` of ``text`` that is reasoning (a leading start tag excluded)."""
    if not thinking:
        return 0, 0
    start = len(tags.start) if text.startswith(tags.start) else 0
    ends = [p for p in (text.find(m, start) for m in (tags.end, *tags.implicit_ends)) if p >= 0]
    return start, min(ends) if ends else len(text)


def _add(pieces: list[tuple[Part, str]], part: Part, text: str) -> None:
    if not text:
        return
    if pieces and pieces[-1][0] == part:
        pieces[-1] = (part, pieces[-1][1] + text)
    else:
        pieces.append((part, text))


def _first(buf: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        pos = buf.find(marker)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, marker)
    return best


def _tag_prefix_len(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``buf`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), longest, -1):
            if marker.startswith(buf[-n:]):
                longest = n
                break
    return longest
