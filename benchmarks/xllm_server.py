"""Our OpenAI server (``python -m xservice serve``) for a model folder, as a benchmark fixture."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmarks.server_process import free_port, run_server

REPO_ROOT = Path(__file__).resolve().parent.parent


def xllm_server_cmd(model_dir: str, port: int, extra_args: list[str] | None = None) -> list[str]:
    """The command line of ``xllm serve`` for ``model_dir`` on 127.0.0.1:``port``."""
    cmd = [sys.executable, "-m", "xservice", "serve", "--model", str(model_dir), "--port", str(port)]
    return cmd + list(extra_args or [])


@contextlib.contextmanager
def xllm_server(
    model_dir: str, port: int | None = None, extra_args: list[str] | None = None
) -> Iterator[str]:
    """Start ``xllm serve`` on ``model_dir``, wait for ``/v1/models``, yield the base URL, stop it."""
    port = port or free_port()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with run_server(xllm_server_cmd(model_dir, port, extra_args), port, env=env, name="xllm") as base_url:
        yield base_url
