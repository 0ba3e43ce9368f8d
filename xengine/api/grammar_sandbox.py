"""Grammar work where a crash or a runaway cannot take the caller down: worker processes with limits.

A crafted schema, regex or grammar can overflow the native grammar library's stack (a SIGSEGV of
the whole process), allocate hundreds of MiB, or run for a long time. The service validates specs
and the engine compiles them, and neither may die or bloat for one request. So each spec first goes
to a sandbox worker (``grammar_worker``, a child process with a capped address space and a small job
stack): it validates the spec and, given the model's tokenizer, compiles it and measures the bytes
the compiled grammar holds. A spec that crashes or times out the worker is refused (the worker is
replaced); the engine then compiles in its own process only specs the sandbox passed, on a thread
with a larger stack than the sandbox's, and charges its cache with the measured size.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xengine.api.grammar_bounds import SpecTooComplexError, check_bounds
from xengine.api.grammar_spec import GrammarSpec

STARTUP_TIMEOUT_S = 120.0  # loading a 151k-vocabulary tokenizer takes ~1 s; a guard, not a budget


@dataclass(frozen=True)
class SandboxLimits:
    """What one spec may take in the sandbox."""

    timeout_s: float = 10.0  # wall time to validate / compile one spec
    memory_bytes: int = 1 << 30  # address space a worker may map past its start-up size
    stack_bytes: int = 4 << 20  # the job thread's stack (the engine compiles on a 16 MiB one)


class SandboxCrashError(SpecTooComplexError):
    """The worker died or timed out on a spec: the spec is refused as too complex."""


class GrammarSandbox:
    """A pool of ``num_workers`` sandbox processes, started on first use. Thread-safe."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        tokenizer_file: str | Path | None = None,
        vocab_size: int = 0,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        num_workers: int = 1,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self._argv = _worker_argv(self.limits, tokenizer_file, vocab_size, eos_token_ids)
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(None)  # started when first taken
        self._closed = False
        self.num_runs = 0
        self.num_crashes = 0
        self.num_timeouts = 0

    def run(self, spec: GrammarSpec) -> int:
        """Validate (and with a tokenizer, compile) ``spec`` in a worker; the compiled bytes it holds
        (0 without a tokenizer). ``ValueError`` saying why when invalid, too complex, crashing or slow."""
        check_bounds(spec)  # the cheap refusals need no process hop
        worker = self._idle.get()
        try:
            if worker is None or not worker.is_alive():
                worker = _Worker(self._argv)
            reply = worker.ask(_job(spec), self.limits.timeout_s)
        except _WorkerDied as e:
            worker = None
            self._count(e)
            raise SandboxCrashError(str(e)) from None
        finally:
            if self._closed and worker is not None:
                worker.kill()
                worker = None
            self._idle.put(worker)
        self.num_runs += 1
        if not reply.get("ok"):
            raise ValueError(str(reply.get("error") or "invalid"))
        return int(reply.get("compiled_bytes", 0))

    def _count(self, error: _WorkerDied) -> None:
        if error.timed_out:
            self.num_timeouts += 1
        else:
            self.num_crashes += 1

    def close(self) -> None:
        """Stop the workers (idle ones now; busy ones when they are handed back)."""
        self._closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


class _WorkerDied(Exception):
    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _Worker:
    """One sandbox process and its line-based pipe protocol."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._buffer = b""
        ready = self._read_reply(time.monotonic() + STARTUP_TIMEOUT_S, timeout_s=STARTUP_TIMEOUT_S)
        if not ready.get("ready"):
            self.kill()
            raise _WorkerDied("the grammar sandbox did not start")

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        return self._read_reply(time.monotonic() + timeout_s, timeout_s)

    def _read_reply(self, deadline: float, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise _WorkerDied(f"compiling it took longer than {timeout_s:g} s", timed_out=True)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise self._died()
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _died(self) -> _WorkerDied:
        code = self.proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return _WorkerDied(
            f"it crashed the grammar compiler ({how}): it is too complex (too deeply nested or too "
            "many chained rules or references) or needs more memory than a grammar may use"
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _job(spec: GrammarSpec) -> dict[str, Any]:
    return {"kind": spec.kind, "source": spec.source, "whitespace": spec.whitespace}


def _worker_argv(
    limits: SandboxLimits, tokenizer_file: str | Path | None, vocab_size: int, eos: Any
) -> list[str]:
    argv = [sys.executable, "-m", "xengine.api.grammar_worker"]
    argv += ["--memory-bytes", str(limits.memory_bytes), "--stack-bytes", str(limits.stack_bytes)]
    argv += ["--parent-pid", str(os.getpid())]
    if tokenizer_file is not None:
        argv += ["--tokenizer", str(tokenizer_file), "--num-ids", str(vocab_size)]
        argv += ["--eos", ",".join(str(t) for t in eos)]
    return argv


_shared: GrammarSandbox | None = None
_shared_lock = threading.Lock()


def shared_validator() -> GrammarSandbox:
    """The process's tokenizer-free sandbox (two workers), for validating specs before they reach an
    engine; created on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = GrammarSandbox(num_workers=2)
        return _shared
