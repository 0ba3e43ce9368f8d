"""LRU cache of compiled grammars, keyed by ``GrammarSpec`` (one cache per backend, i.e. per tokenizer).

Agents and batch jobs send the same schema over and over; a hit skips compiling entirely and the
request is scheduled in the same step it arrives. Thread-safe: the engine thread reads it, the
compile worker fills it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from xengine.api.grammar import GrammarSpec
from xengine.structured.backend import BaseCompiledGrammar

DEFAULT_MAX_ENTRIES = 256


class CompiledGrammarCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
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
        with self._lock:
            self._entries[spec] = compiled
            self._entries.move_to_end(spec)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
