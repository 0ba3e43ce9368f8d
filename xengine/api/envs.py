"""Every ``XLLM_*`` environment variable xllm reads: name, default and meaning, each once (docs/operations.md).

Accessors read ``os.environ`` when called (never at import), so a test or a parent process may set a
variable at any time. A leaf of the contract: it imports nothing of the project, which is why
``ops`` and ``memory`` may import it (``tests/test_layering.py``). Variables only the tests, the
benchmarks or ``ci/`` read (``XLLM_FUZZ_LONG``, ``XLLM_BENCH_VLLM_VENV``, ``XLLM_COMPAT_*``,
``XLLM_ETCD_DATA_DIR``, ``XLLM_TORCH_VERSION``) are not product configuration and stay with their reader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, the value when unset or empty, what it does, and whether
    xllm sets it itself for a child process (``internal``: not something an operator sets)."""

    name: str
    default: str
    doc: str
    internal: bool = False

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        """The value in ``environ`` (default: the process environment), else ``default``."""
        return (os.environ if environ is None else environ).get(self.name) or self.default

    def pop(self) -> str:
        """The value, removed from the process environment (a secret or a one-shot hand-over)."""
        return os.environ.pop(self.name, "") or self.default


CACHE_DIR = EnvVar(
    "XLLM_CACHE_DIR",
    "",
    "Root of xllm's cached files: default model, batch store, cluster key, EPD profiles, built C "
    "kernels (default ~/.cache/xllm).",
)
DEVICE = EnvVar(
    "XLLM_DEVICE", "", "Device when device.device is unset: cpu, cuda or npu (default: detected)."
)
CPU_KERNELS = EnvVar(
    "XLLM_CPU_KERNELS",
    "auto",
    "The CPU backend's C kernels: 'auto' (built and used where they apply), 'off', or a list of "
    "kernels to turn off ('-elementwise,-row_argmax').",
)
API_KEY = EnvVar(
    "XLLM_API_KEY",
    "",
    "The HTTP API key when neither service.api_key nor service.api_key_file is set (not passed to engines).",
)
ENGINE_LOG_LEVEL = EnvVar("XLLM_ENGINE_LOG_LEVEL", "INFO", "Log level of engine processes.")
CLUSTER_KEY = EnvVar(
    "XLLM_CLUSTER_KEY",
    "",
    "The cluster key the service hands to an engine it launches (removed from the environment once read).",
    internal=True,
)
BIND_HOST = EnvVar(
    "XLLM_BIND_HOST",
    "",
    "The host the bind-host shim (memory/bind_host) moves wildcard listens of the KV-transfer library to.",
    internal=True,
)
SERVE_LISTEN_FD = EnvVar(
    "XLLM_SERVE_LISTEN_FD",
    "",
    "The listening socket a watchdog hands to the API server it runs.",
    internal=True,
)
WATCHDOG_PID = EnvVar(
    "XLLM_WATCHDOG_PID",
    "",
    "The pid of the watchdog running the API server (the server dies with it).",
    internal=True,
)
HOST_ID = EnvVar(
    "XLLM_HOST_ID",
    "",
    "The host a parallel worker rank reports to its group (a Ray actor sets its node id): ranks that all "
    "share one all-reduce through shared memory.",
    internal=True,
)

ALL: tuple[EnvVar, ...] = (
    CACHE_DIR,
    DEVICE,
    CPU_KERNELS,
    API_KEY,
    ENGINE_LOG_LEVEL,
    CLUSTER_KEY,
    BIND_HOST,
    SERVE_LISTEN_FD,
    WATCHDOG_PID,
    HOST_ID,
)


def cache_dir() -> Path:
    """``$XLLM_CACHE_DIR``, else ``~/.cache/xllm``."""
    return Path(CACHE_DIR.get() or Path.home() / ".cache" / "xllm")
