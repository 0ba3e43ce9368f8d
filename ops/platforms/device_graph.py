"""Device graphs (CUDA graphs, Ascend ACLGraph): record a callable's kernels once, replay them later.

A captured graph replays the same kernels on the same addresses: inputs must be copied into the
tensors it was captured with, and its outputs are overwritten by the next replay. ``graph/`` builds
its piecewise and full-step runners on this interface; the platforms that have device graphs return
one from ``Platform.device_graphs()``. CUDA's is ``torch.cuda.CUDAGraph``; the NPU's is
``torch.npu.NPUGraph`` (``torch_npu``, imported lazily) with the same API.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol


class Graph(Protocol):
    def replay(self) -> None: ...


class DeviceGraphs(ABC):
    """Capture and replay of device graphs on one platform."""

    # compile the captured pieces with inductor first (Triton on CUDA); False where inductor has no
    # backend for the device (NPU): the pieces' aten ops are captured as they are
    compiles_pieces: bool = True

    @abstractmethod
    def new_pool(self) -> Any:
        """A memory pool handle graphs can share (buckets and pieces captured into one pool)."""

    @abstractmethod
    def capture(self, fn: Callable[[], Any], pool: Any) -> tuple[Graph, Any]:
        """Record ``fn()``'s device work into a new graph allocating from ``pool``; returns the graph
        and ``fn``'s outputs (tensors the replays write). The recorded work has not run yet."""

    def synchronize(self) -> None:
        """Wait for the device (captures are bracketed by it)."""
        return None


class TorchDeviceGraphs(DeviceGraphs):
    """The ``torch.cuda`` graph API, or a module with the same one (``torch.npu`` from ``torch_npu``)."""

    def __init__(self, module: Callable[[], Any], graph_class: str, compiles_pieces: bool) -> None:
        self._module = module  # called lazily: importing torch_npu must wait until it is needed
        self._graph_class = graph_class
        self.compiles_pieces = compiles_pieces

    def new_pool(self) -> Any:
        return self._module().graph_pool_handle()

    def capture(self, fn: Callable[[], Any], pool: Any) -> tuple[Graph, Any]:
        mod = self._module()
        graph = getattr(mod, self._graph_class)()
        mod.synchronize()
        with mod.graph(graph, pool=pool):  # records on a side stream; nothing runs yet
            out = fn()
        mod.synchronize()
        return graph, out

    def synchronize(self) -> None:
        self._module().synchronize()
