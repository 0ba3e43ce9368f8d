"""Grammar compilation off the engine loop: a worker thread, the compiled-grammar cache in front of it.

``submit(spec)`` returns at once: a finished future on a cache hit, else the future of a compile
running on the worker (one per distinct spec: concurrent requests with the same schema share it).
Each new spec is first compiled in the grammar sandbox (``xengine.api.grammar_sandbox``: a child
process with memory and time limits, where a crash or a runaway hurts nobody), which also measures
its compiled size; only a spec that passed there and is under ``max_compiled_bytes`` is compiled in
this process, on a thread whose stack is larger than the sandbox's. The backend itself (its tokenizer
tables, costly on a large vocabulary) is built on the worker at the first compile, so an engine that
never sees a constrained request never pays for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from xengine.api.grammar import GrammarSpec
from xengine.api.grammar_sandbox import GrammarSandbox
from xengine.structured.backend import BaseCompiledGrammar, BaseGrammarBackend
from xengine.structured.cache import CompiledGrammarCache

COMPILE_STACK_BYTES = 16 << 20  # the in-process compile's stack: 4x the sandbox's (SandboxLimits)
DEFAULT_MAX_COMPILED_BYTES = 64 << 20


class GrammarCompiler:
    def __init__(
        self,
        backend_factory: Callable[[], BaseGrammarBackend],
        cache: CompiledGrammarCache | None = None,
        sandbox: GrammarSandbox | None = None,
        max_compiled_bytes: int = DEFAULT_MAX_COMPILED_BYTES,
    ) -> None:
        self._backend_factory = backend_factory
        self._backend: BaseGrammarBackend | None = None
        self.cache = cache if cache is not None else CompiledGrammarCache()
        self.sandbox = sandbox
        self.max_compiled_bytes = max_compiled_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xengine-grammar")
        self._lock = threading.Lock()  # guards _in_flight (the engine thread takes it: never held long)
        self._backend_lock = threading.Lock()
        self._in_flight: dict[GrammarSpec, Future[BaseCompiledGrammar]] = {}
        self.num_compiles = 0
        self.num_refused_too_large = 0

    def submit(self, spec: GrammarSpec) -> Future[BaseCompiledGrammar]:
        """The compiled grammar of ``spec``, now (cache hit) or later; a failed compile's future holds
        the ``ValueError`` saying why the spec is invalid, too complex or too large."""
        compiled = self.cache.get(spec)
        if compiled is not None:
            done: Future[BaseCompiledGrammar] = Future()
            done.set_result(compiled)
            return done
        with self._lock:
            future = self._in_flight.get(spec)
            if future is None:
                future = self._submit_with_stack(spec)
                self._in_flight[spec] = future
                future.add_done_callback(lambda _, spec=spec: self._forget(spec))
            return future

    def _submit_with_stack(self, spec: GrammarSpec) -> Future[BaseCompiledGrammar]:
        # the pool starts its thread inside submit: give that thread the compile stack
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            return self._pool.submit(self._compile, spec)
        finally:
            threading.stack_size(previous)

    def _forget(self, spec: GrammarSpec) -> None:
        with self._lock:
            self._in_flight.pop(spec, None)

    def _compile(self, spec: GrammarSpec) -> BaseCompiledGrammar:
        compiled_bytes = self.sandbox.run(spec) if self.sandbox is not None else 0
        if compiled_bytes > self.max_compiled_bytes:
            self.num_refused_too_large += 1
            raise ValueError(
                f"it compiles to {compiled_bytes / 2**20:.0f} MiB, over this server's limit of "
                f"{self.max_compiled_bytes / 2**20:.0f} MiB per grammar; simplify it (e.g. smaller repetition counts)"
            )
        compiled = self.backend().compile(spec)
        self.cache.put(spec, compiled, compiled_bytes)
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
        if self.sandbox is not None:
            self.sandbox.close()
