"""Grammar compilation off the engine loop: a worker thread, the compiled-grammar cache in front of it.

``submit(spec)`` returns at once: a finished future on a cache hit, else the future of a compile
running on the worker (one per distinct spec: concurrent requests with the same schema share it).
The backend itself (tokenizer tables: ~1 s on a 151k vocabulary) is built on the worker at the first
compile, so an engine that never sees a constrained request never pays for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from xengine.api.grammar import GrammarSpec
from xengine.structured.backend import BaseCompiledGrammar, BaseGrammarBackend
from xengine.structured.cache import CompiledGrammarCache


class GrammarCompiler:
    def __init__(
        self,
        backend_factory: Callable[[], BaseGrammarBackend],
        cache: CompiledGrammarCache | None = None,
        num_workers: int = 1,
    ) -> None:
        self._backend_factory = backend_factory
        self._backend: BaseGrammarBackend | None = None
        self.cache = cache if cache is not None else CompiledGrammarCache()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="xengine-grammar")
        self._lock = threading.Lock()  # guards _in_flight (the engine thread takes it: never held long)
        self._backend_lock = threading.Lock()
        self._in_flight: dict[GrammarSpec, Future[BaseCompiledGrammar]] = {}
        self.num_compiles = 0

    def submit(self, spec: GrammarSpec) -> Future[BaseCompiledGrammar]:
        """The compiled grammar of ``spec``, now (cache hit) or later; a failed compile's future holds
        the ``ValueError`` saying why the spec is invalid."""
        compiled = self.cache.get(spec)
        if compiled is not None:
            done: Future[BaseCompiledGrammar] = Future()
            done.set_result(compiled)
            return done
        with self._lock:
            future = self._in_flight.get(spec)
            if future is None:
                future = self._pool.submit(self._compile, spec)
                self._in_flight[spec] = future
                future.add_done_callback(lambda _, spec=spec: self._forget(spec))
            return future

    def _forget(self, spec: GrammarSpec) -> None:
        with self._lock:
            self._in_flight.pop(spec, None)

    def _compile(self, spec: GrammarSpec) -> BaseCompiledGrammar:
        compiled = self.backend().compile(spec)
        self.cache.put(spec, compiled)
        self.num_compiles += 1
        return compiled

    def backend(self) -> BaseGrammarBackend:
        """The backend, built on first use (on whichever thread asks first: normally the worker)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
