"""Start an OpenAI-compatible server as a subprocess, wait until it answers, stop it on exit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Poll ``GET {base_url}/models`` until it returns 200; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with code {proc.returncode}; log tail:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/models", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"server at {base_url} not ready after {timeout_s:.0f} s (log: {log_path})")


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, then SIGKILL it after ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def run_server(
    cmd: list[str],
    port: int,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    name: str = "server",
    log: Path | None = None,
    inherit_env: bool = True,
) -> Iterator[str]:
    """Run ``cmd`` (which must listen on 127.0.0.1:``port``) and yield its ``/v1`` base URL.

    ``env`` is added to this process's environment (``inherit_env``) or is the whole of it; the
    server's output goes to ``log`` (default: a new temporary file)."""
    base_url = f"http://127.0.0.1:{port}/v1"
    log = log or Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
    print(f"starting {name}: {' '.join(cmd)} (log: {log})", file=sys.stderr)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})} if inherit_env else dict(env or {}),
            start_new_session=True,
        )
        try:
            t0 = time.monotonic()
            wait_ready(base_url, proc, timeout_s, log)
            print(f"{name} ready after {time.monotonic() - t0:.1f} s", file=sys.stderr)
            yield base_url
        finally:
            stop(proc)
