"""Stop strings over streamed text: emit only text that cannot be the start of a stop string."""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas; get back the text safe to emit and the stop string once one matches.

    A suffix that could still grow into a stop string is held back, so a stop string never
    leaks into emitted text. When several stop strings occur, the one that completes first in
    the text wins (as if the text had arrived one character at a time).
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self.matched: str | None = None

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        """Return ``(text to emit now, matched stop string or None)``; after a match, feeds emit nothing."""
        if self.matched is not None:
            return "", None
        buf = self._held + text_delta
        hit = self._first_match(buf)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._held = ""
            end = start + len(stop) if self.include_stop_str_in_output else start
            return buf[:end], stop
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """Release the held-back text at the end of generation (nothing after a match)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first; ties go to the longer one."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stop:
            start = buf.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            lo = max(len(buf) - len(stop) + 1, 0)
            pos = buf.find(stop[0], lo)
            while pos >= 0:
                if stop.startswith(buf[pos:]):
                    longest = max(longest, len(buf) - pos)
                    break  # the earliest start is the longest suffix for this stop string
                pos = buf.find(stop[0], pos + 1)
        return longest
