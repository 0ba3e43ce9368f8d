"""LRU cache of compiled grammars, keyed by ``GrammarSpec`` (one cache per backend, i.e. per tokenizer).

Agents and batch jobs send the same schema over and over; a hit skips compiling entirely and the
request is scheduled in the same step it arrives. Thread-safe: the engine thread reads it, the
compile worker fills it.

Bounded twice: by entries, and by the characters of the specs it keys on (a schema may be up to
1 MiB, ``xengine.api.constraints.MAX_GRAMMAR_CHARS``, so clients choosing schemas could otherwise pin
hundreds of MiB). Each compiled grammar's own state is bounded by llguidance's parser limits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from xengine.api.grammar import GrammarSpec
from xengine.structured.backend import BaseCompiledGrammar

DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_SOURCE_CHARS = 16 << 20


def _size(spec: GrammarSpec) -> int:
    return len(spec.source) + len(spec.whitespace or "")


class CompiledGrammarCache:
    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, max_source_chars: int = DEFAULT_MAX_SOURCE_CHARS
    ) -> None:
        self.max_entries = max_entries
        self.max_source_chars = max_source_chars
        self.num_source_chars = 0
        self._entries: OrderedDict[GrammarSpec, BaseCompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def get(self, spec: GrammarSpec) -> BaseCompiledGrammar | None:
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is None:
                self.num_misses += 1
                return None
            self._entries.move_to_end(spec)
            self.num_hits += 1
            return compiled

    def put(self, spec: GrammarSpec, compiled: BaseCompiledGrammar) -> None:
        if _size(spec) > self.max_source_chars:
            return  # would evict everything else; compiled again if it comes back
        with self._lock:
            if spec not in self._entries:
                self.num_source_chars += _size(spec)
            self._entries[spec] = compiled
            self._entries.move_to_end(spec)
            while len(self._entries) > self.max_entries or self.num_source_chars > self.max_source_chars:
                evicted, _ = self._entries.popitem(last=False)
                self.num_source_chars -= _size(evicted)

    def __len__(self) -> int:
        return len(self._entries)
