"""Ascend NPU platform. ``torch_npu`` is imported lazily inside methods, never at module import:
installing it without CANN breaks ``import torch``, so CPU environments must never have it."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from ops.platforms.base import Capabilities, Platform
from ops.platforms.device_graph import DeviceGraphs, TorchDeviceGraphs
from ops.platforms.vmm import BaseVMM


def _torch_npu() -> Any:
    """Import ``torch_npu`` (registers the ``npu`` device with torch) and return it."""
    return importlib.import_module("torch_npu")


class NpuPlatform(Platform):
    name = "npu"

    _CAPS = Capabilities(
        supports_bf16=True,
        supports_fp16=True,
        supports_graphs=True,
        supports_vmm=True,
        dist_backend="hccl",
        # ``partial`` (piecewise ACLGraph, graph/piecewise.py) has never run on an NPU: not the default
        default_graph_mode="eager",
        default_async_scheduling=True,  # the device runs the forward: host work overlaps it
    )

    @property
    def capabilities(self) -> Capabilities:
        return self._CAPS

    @classmethod
    def is_available(cls) -> bool:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            return bool(_torch_npu().npu.is_available())
        except Exception:  # a broken CANN install must not break detection
            return False

    def torch_device(self, index: int = 0) -> torch.device:
        _torch_npu()
        return torch.device("npu", index)

    def synchronize(self) -> None:
        _torch_npu().npu.synchronize()

    def total_memory_bytes(self) -> int:
        npu = _torch_npu().npu
        return npu.get_device_properties(npu.current_device()).total_memory

    def memory_stats(self) -> dict[str, int]:
        npu = _torch_npu().npu
        free, total = npu.mem_get_info()
        return {
            "total_bytes": total,
            "free_bytes": free,
            "used_bytes": total - free,
            "allocated_bytes": npu.memory_allocated(),
            "reserved_bytes": npu.memory_reserved(),
        }

    def empty_cache(self) -> None:
        _torch_npu().npu.empty_cache()

    def device_graphs(self) -> DeviceGraphs:
        # ACLGraph through torch_npu's NPUGraph; inductor has no NPU backend: pieces run as aten ops
        return TorchDeviceGraphs(lambda: _torch_npu().npu, "NPUGraph", compiles_pieces=False)

    def vmm(self) -> BaseVMM:
        from ops.platforms.npu_vmm import NpuVMM

        return NpuVMM(_torch_npu().npu.current_device())
