"""``GraphRunner`` ABC: capture(sizes) / can_replay(batch) / replay(batch); eager by default.

Platforms register their graph runner (CUDA graphs, NPU ACLGraph, partial-graph mode) in
``create_graph_runner``; the CPU platform runs eagerly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch


class GraphRunner(ABC):
    def __init__(self, forward: Callable[..., torch.Tensor]) -> None:
        self.forward = forward

    @abstractmethod
    def capture(self, sizes: list[int]) -> None:
        """Record the forward for these token counts (no-op for eager)."""

    @abstractmethod
    def can_replay(self, num_tokens: int, is_all_decode: bool) -> bool: ...

    @abstractmethod
    def replay(self, *args: Any) -> torch.Tensor: ...

    def run(self, num_tokens: int, is_all_decode: bool, *args: Any) -> torch.Tensor:
        if self.can_replay(num_tokens, is_all_decode):
            return self.replay(*args)
        return self.forward(*args)


class EagerGraphRunner(GraphRunner):
    """Runs the forward as-is every time (the CPU backend and the reference)."""

    def capture(self, sizes: list[int]) -> None:
        return None

    def can_replay(self, num_tokens: int, is_all_decode: bool) -> bool:
        return False

    def replay(self, *args: Any) -> torch.Tensor:
        return self.forward(*args)


_FACTORIES: dict[str, Callable[[Callable[..., torch.Tensor]], GraphRunner]] = {}


def register_graph_runner(
    platform_name: str, factory: Callable[[Callable[..., torch.Tensor]], GraphRunner]
) -> None:
    _FACTORIES[platform_name] = factory


def create_graph_runner(platform_name: str, forward: Callable[..., torch.Tensor]) -> GraphRunner:
    return _FACTORIES.get(platform_name, EagerGraphRunner)(forward)
