"""What a benchmark ran on, for its JSON: the CPU (model, cores, instruction sets), torch and threads."""

from __future__ import annotations

import dataclasses
import os

import torch

from ops.cpu_kernels.build import build_all
from ops.platforms.cpu_features import cpu_features


def describe(threads_per_process: int | None = None) -> dict:
    """The ``machine`` section of a benchmark's JSON (``threads_per_process``: what each runner used)."""
    return {
        "cpu": dataclasses.asdict(cpu_features()),
        # which C kernels run here ("ok") or why not: e.g. panel_gemm_bf16 needs avx512_bf16
        "cpu_kernels": build_all(),
        "torch": torch.__version__,
        "threads_per_process": threads_per_process,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
