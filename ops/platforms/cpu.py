"""CPU platform: the reference backend that every test runs on."""

from __future__ import annotations

import os
import resource

import torch

from ops.platforms.base import Capabilities, Platform
from ops.platforms.vmm import BaseVMM


class CpuPlatform(Platform):
    name = "cpu"

    # float16 matmuls on CPU are slow and lose accuracy; bfloat16 is supported natively.
    # VMM: xTensor maps memfd pages into a reserved range with mmap(MAP_FIXED).
    _CAPS = Capabilities(
        supports_bf16=True, supports_fp16=False, supports_graphs=False, supports_vmm=True, dist_backend="gloo"
    )

    @property
    def capabilities(self) -> Capabilities:
        return self._CAPS

    @classmethod
    def is_available(cls) -> bool:
        return True

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        """CPU ops are synchronous."""

    def vmm(self) -> BaseVMM:
        from ops.platforms.cpu_vmm import CpuVMM

        return CpuVMM()

    def serving_num_threads(self) -> int | None:
        """All cores but one: the service process needs a core, and OpenMP threads that outnumber
        the free cores spin-wait on each other (measured: ~40x slower decode steps on 2 cores)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores - 1)

    def total_memory_bytes(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def memory_stats(self) -> dict[str, int]:
        total = self.total_memory_bytes()
        free = _meminfo_bytes("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        # ru_maxrss is in KiB on Linux: peak resident set of this process.
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "total_bytes": total,
            "free_bytes": free,
            "used_bytes": total - free,
            "peak_rss_bytes": peak_rss,
        }


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
