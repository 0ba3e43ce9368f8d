"""CUDA platform, written against ``torch.cuda`` (importable without a GPU)."""

from __future__ import annotations

import torch

from ops.platforms.base import Capabilities, Platform
from ops.platforms.device_graph import DeviceGraphs, TorchDeviceGraphs
from ops.platforms.vmm import BaseVMM


def device_capability(device: torch.device) -> tuple[tuple[int, int] | None, str]:
    """``(compute capability, name)`` of the CUDA device ``device``; ``(None, type)`` for any other
    device (the CUDA backend's layers also run on CPU tensors in tests)."""
    if device.type != "cuda":
        return None, device.type
    return torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)


class CudaPlatform(Platform):
    name = "cuda"

    def __init__(self) -> None:
        self._caps: Capabilities | None = None

    @property
    def capabilities(self) -> Capabilities:
        if self._caps is None:
            self._caps = Capabilities(
                supports_bf16=torch.cuda.is_bf16_supported(),
                supports_fp16=True,
                supports_graphs=True,
                supports_vmm=True,
                dist_backend="nccl",
                default_graph_mode="partial",
                default_async_scheduling=True,  # the device runs the forward: host work overlaps it
            )
        return self._caps

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device("cuda", index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def total_memory_bytes(self) -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def memory_stats(self) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info()
        return {
            "total_bytes": total,
            "free_bytes": free,
            "used_bytes": total - free,
            "allocated_bytes": torch.cuda.memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(),
        }

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def vmm(self) -> BaseVMM:
        from ops.platforms.cuda_vmm import CudaVMM

        return CudaVMM(torch.cuda.current_device())

    def device_graphs(self) -> DeviceGraphs:
        return TorchDeviceGraphs(lambda: torch.cuda, "CUDAGraph", compiles_pieces=True)
