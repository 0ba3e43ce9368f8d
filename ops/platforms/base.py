"""``Platform``: the one seam between device-agnostic code and a concrete accelerator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ops.platforms.device_graph import DeviceGraphs
from ops.platforms.vmm import BaseVMM


@dataclass(frozen=True)
class Capabilities:
    """What a platform can do; callers branch on these, never on the platform's name."""

    supports_bf16: bool
    supports_fp16: bool
    supports_graphs: bool  # capture/replay of whole forward passes (CUDA graphs, ACLGraph)
    supports_vmm: bool  # map physical pages into a reserved virtual range (xTensor)
    dist_backend: str  # torch.distributed backend: gloo | nccl | hccl
    default_kv_layout: str = "paged"  # what cache.kv_layout "auto" picks: paged | xtensor
    default_graph_mode: str = "eager"  # what execution.graph_mode "auto" picks: eager | partial | full
    default_async_scheduling: bool = False  # what execution.async_scheduling "auto" picks
    default_encode_overlap: bool = False  # what execution.encode_overlap "auto" picks
    emulated: bool = False  # the forward is a timed stand-in (``emulated.py``), not the model's math


class Platform(ABC):
    """A device family. Resolved once per process (see ``ops.platforms.resolve_platform``)."""

    name: str

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """Static capabilities of this platform."""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """True if this platform can be used in the current process."""

    @abstractmethod
    def torch_device(self, index: int = 0) -> torch.device:
        """The ``torch.device`` for device ``index`` of this platform."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all queued work on the current device has finished."""

    @abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Memory figures in bytes: at least ``total_bytes``, ``free_bytes`` and ``used_bytes``."""

    @abstractmethod
    def total_memory_bytes(self) -> int:
        """Total memory of the current device (host RAM on CPU)."""

    def configure(self, device_profile: str | None) -> None:
        """Settings beyond the device's name: a device profile is only the emulated platform's."""
        if device_profile:
            raise ValueError(
                f"device.device_profile is for --device emulated; device {self.name!r} runs the model itself"
            )

    def emulate_step(self, query_lens: list[int], seq_lens: list[int], started: float) -> None:  # noqa: B027
        """After a step's forward (its sequences' new tokens and contexts; when it started): nothing on a
        real device; the emulated one waits out the step's predicted time."""

    def set_num_threads(self, n: int | None) -> None:
        """Set host intra-op threads; ``None`` keeps torch's default."""
        if n is not None:
            if n < 1:
                raise ValueError(f"num_threads must be >= 1, got {n}")
            torch.set_num_threads(n)

    def serving_num_threads(self) -> int | None:
        """Intra-op threads for an engine process that shares the host with the HTTP service
        (``None``: keep torch's default)."""
        return None

    def vmm(self) -> BaseVMM:
        """This device's virtual memory management calls (xTensor); only where ``supports_vmm``."""
        raise NotImplementedError(f"{self.name} has no VMM support; use the paged KV layout")

    def device_graphs(self) -> DeviceGraphs:
        """Capture / replay of device graphs (``ops/platforms/device_graph.py``); only where
        ``supports_graphs``."""
        raise NotImplementedError(f"{self.name} has no device graphs; use graph mode eager or partial")

    def empty_cache(self) -> None:
        """Release cached, unused device memory back to the driver (no-op where there is none)."""
        return None

    def default_dtype_for(self, requested: torch.dtype) -> torch.dtype:
        """The dtype actually used when ``requested`` is asked for (unsupported types are widened)."""
        caps = self.capabilities
        if requested == torch.bfloat16 and not caps.supports_bf16:
            return torch.float32
        if requested == torch.float16 and not caps.supports_fp16:
            return torch.float32
        return requested

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
