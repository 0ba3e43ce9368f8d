"""LRU cache of compiled grammars, keyed by ``GrammarSpec`` (one cache per backend, i.e. per tokenizer).

Agents and batch jobs send the same schema over and over; a hit skips compiling entirely and the
request is scheduled in the same step it arrives. Thread-safe: the engine thread reads it, the
compile worker fills it.

Bounded by entries and by bytes: each entry is charged the compiled size the grammar sandbox
measured (its lexer and parser state after the first mask, which a tiny regex such as
``b{2147483647}`` inflates enormously) plus its spec's text, so clients choosing specs cannot pin
more than ``max_bytes`` however small their specs are.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from xengine.api.grammar import GrammarSpec
from xengine.structured.backend import BaseCompiledGrammar

DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_BYTES = 512 << 20


def _text_bytes(spec: GrammarSpec) -> int:
    return len(spec.source) + len(spec.whitespace or "")


class CompiledGrammarCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[GrammarSpec, tuple[BaseCompiledGrammar, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def get(self, spec: GrammarSpec) -> BaseCompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(spec)
            if entry is None:
                self.num_misses += 1
                return None
            self._entries.move_to_end(spec)
            self.num_hits += 1
            return entry[0]

    def put(self, spec: GrammarSpec, compiled: BaseCompiledGrammar, compiled_bytes: int) -> None:
        """Keep ``compiled`` (measured at ``compiled_bytes``), evicting the least recently used."""
        size = compiled_bytes + _text_bytes(spec)
        if size > self.max_bytes:
            return  # would evict everything else; compiled again if it comes back
        with self._lock:
            old = self._entries.pop(spec, None)
            if old is not None:
                self.num_bytes -= old[1]
            self._entries[spec] = (compiled, size)
            self.num_bytes += size
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.num_bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)
