"""An engine child process of the service: its environment, spawn, readiness, stderr and exit.

``EngineProcess`` is the process half of a single-node ``EngineClient`` (``client.py``), which keeps
the sockets; ``child_env`` is also what cluster launchers and ``xllm engine`` start engines with.
The engine's stderr is passed through to ours, its tail kept for startup errors
(``docs/operations.md``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

import msgspec
import zmq.asyncio

from xengine.api.config import EngineConfig
from xengine.api.entrypoints import ENGINE_PROC_MODULE
from xengine.api.envs import API_KEY
from xengine.api.messages import EngineDead, EngineInfo, Ready
from xservice.engine.errors import EngineStartupError

STDERR_TAIL_LINES = 40
POLL_INTERVAL_S = 0.2


class StderrTee:
    """Copies the engine's stderr to ours, keeping the last lines for error messages."""

    def __init__(self, pipe: IO[bytes]):
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._thread = threading.Thread(target=self._pump, args=(pipe,), daemon=True, name="engine-stderr")
        self._thread.start()

    def _pump(self, pipe: IO[bytes]) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self._tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our stderr is closed; keep draining the pipe so the engine never blocks
        pipe.close()

    def tail(self, wait_s: float = 0.5) -> str:
        self._thread.join(wait_s)
        return "\n".join(self._tail)


def child_env() -> dict[str, str]:
    """Our environment, with this checkout first on PYTHONPATH so the engine runs the same code."""
    env = dict(os.environ)
    env.pop(API_KEY.name, None)  # the service's secret; engines never need it
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding xservice/ and xengine/
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in parts if p != root])
    return env


class EngineProcess:
    """``python -m xengine.process.engine_proc`` as a child of the service, connecting to sockets in a private
    folder (``input_addr`` / ``output_addr``, bound by the client before ``spawn``)."""

    def __init__(self) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="xllm-engine-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._tee: StderrTee | None = None

    @property
    def input_addr(self) -> str:
        return f"ipc://{self.ipc_dir}/input"

    @property
    def output_addr(self) -> str:
        return f"ipc://{self.ipc_dir}/output"

    def spawn(self, engine_config: EngineConfig) -> None:
        cmd = [
            sys.executable,
            "-m",
            ENGINE_PROC_MODULE,
            "--config-json",
            json.dumps(dataclasses.asdict(engine_config)),
            "--input-addr",
            self.input_addr,
            "--output-addr",
            self.output_addr,
            "--parent-pid",
            str(os.getpid()),
        ]
        # A new session keeps the terminal's Ctrl-C away from the engine: the service shuts it down.
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env(), start_new_session=True
        )
        assert self._proc.stderr is not None
        self._tee = StderrTee(self._proc.stderr)

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    @property
    def exit_code(self) -> int | None:
        """The exit code once the process ended; None while it runs."""
        return self._proc.poll() if self._proc is not None else None

    def stderr_tail(self, wait_s: float = 0.5) -> str:
        return self._tee.tail(wait_s) if self._tee is not None else ""

    async def wait_ready(
        self, pull: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder, timeout_s: float
    ) -> EngineInfo:
        """The engine's ``Ready`` info from ``pull``; ``EngineStartupError`` (with the stderr tail) if
        it fails, exits or is not ready within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if await pull.poll(int(POLL_INTERVAL_S * 1000)):
                msg = decoder.decode(await pull.recv())
                if isinstance(msg, Ready):
                    return msg.info
                if isinstance(msg, EngineDead):
                    await self.wait_exit(5.0)
                    raise self._startup_error(msg.message)
            elif self.exit_code is not None:
                raise self._startup_error(f"engine process exited with code {self.exit_code} during startup")
            if loop.time() > deadline:
                raise self._startup_error(
                    f"engine not ready after {timeout_s:.0f}s (raise service.engine_startup_timeout_s)", 0.0
                )

    def _startup_error(self, message: str, wait_s: float = 0.5) -> EngineStartupError:
        return EngineStartupError(f"{message}\n--- engine stderr (tail) ---\n{self.stderr_tail(wait_s)}")

    async def wait_exit(self, timeout_s: float) -> bool:
        """True once the process exited, False if it still runs after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.exit_code is None and self._proc is not None:
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self, timeout_s: float) -> None:
        """Wait ``timeout_s`` for the (asked to drain) process to exit; terminate, then kill it if not."""
        if self._proc is None or await self.wait_exit(timeout_s):
            return
        self._proc.terminate()
        if not await self.wait_exit(5.0):
            self._proc.kill()
            await self.wait_exit(5.0)

    def kill(self) -> None:
        """Kill the process now and reap it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def remove_dir(self) -> None:
        """Remove the socket folder (once the client closed its sockets)."""
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
