"""What this CPU can run: its model name and the instruction sets the kernels and dtypes depend on.

Boxes differ (some AMD EPYC have ``avx512_bf16`` and VNNI, some Intel have VNNI and no bf16), so
kernels, dtype choices and every benchmark's JSON ask here instead of assuming.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


@dataclasses.dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    logical_cores: int
    torch_capability: str  # what torch's own kernels dispatch to: DEFAULT, AVX2, AVX512, AMX ...
    avx512f: bool
    avx512_bf16: bool
    avx512_vnni: bool
    amx_bf16: bool
    amx_int8: bool
    avx2_fma_f16c: bool = False  # what the C kernels' AVX2 builds need (ops/cpu_kernels/avx512_on_avx2.h)


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """The first processor's model name and flags from ``/proc/cpuinfo`` text."""
    name, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "unknown":
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def cpu_features(cpuinfo: str | None = None) -> CpuFeatures:
    """This machine's features (``cpuinfo``: text to parse instead of ``/proc/cpuinfo``)."""
    if cpuinfo is None:
        cpuinfo = CPUINFO.read_text() if CPUINFO.exists() else ""
    name, flags = parse_cpuinfo(cpuinfo)
    return CpuFeatures(
        model_name=name,
        logical_cores=os.cpu_count() or 1,
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        avx512f="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        avx512_vnni="avx512_vnni" in flags,
        amx_bf16="amx_bf16" in flags,
        amx_int8="amx_int8" in flags,
        avx2_fma_f16c={"avx2", "fma", "f16c"} <= flags,
    )
