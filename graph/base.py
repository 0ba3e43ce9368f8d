"""``GraphRunner`` ABC: ``capture(sizes)`` / ``can_replay(num_tokens)`` / ``replay(...)``; eager by default.

A graph runner runs the model's token work (``forward_tokens(input_ids, positions)``) for a step whose
attention context is already set (``graph/forward_context.py``). ``create_graph_runner`` picks one by
mode and platform from a registry that backends add to lazily: ``partial`` (everything but attention
compiled per token-count bucket: inductor's C++ kernels on CPU, ``graph/partial.py``; on CUDA and
the NPU the pieces between attention calls captured as device graphs, ``graph/piecewise.py``),
and ``full`` on CUDA (whole decode steps as device graphs, the rest piecewise, ``graph/full.py``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GraphStats:
    mode: str
    buckets: list[int] = field(default_factory=list)
    capture_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds to compile / capture it
    num_compiles: int = 0  # graphs built since start (one per bucket after warm-up)
    num_recompiles_after_warmup: int = 0  # should stay 0: a new shape or a failed guard
    num_replays: int = 0
    num_eager_steps: int = 0  # steps larger than the largest bucket
    # full mode (``graph/full.py``): decode batch sizes captured as whole-step graphs
    decode_graph_buckets: list[int] = field(default_factory=list)
    decode_graph_capture_s: dict[int, float] = field(default_factory=dict)
    num_decode_graph_replays: int = 0  # decode steps run as one whole-step graph


class GraphRunner(ABC):
    mode = "eager"

    def __init__(self, forward: Forward) -> None:
        self.forward = forward
        self.stats = GraphStats(self.mode)

    @abstractmethod
    def capture(self, sizes: list[int], device: torch.device) -> None:
        """Build the graphs for these token counts on ``device`` (no-op for eager)."""

    @abstractmethod
    def can_replay(self, num_tokens: int) -> bool: ...

    @abstractmethod
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def bind_kv(self, caches: list[Any], block_size: int, max_blocks_per_seq: int) -> None:
        """The per-layer KV caches the model's attention reads (before ``capture``): runners that
        capture attention itself (``full``) size their block-table buffers from this."""
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.can_replay(input_ids.shape[0]):
            self.stats.num_replays += 1
            return self.replay(input_ids, positions)
        self.stats.num_eager_steps += 1
        return self.forward(input_ids, positions)


class EagerGraphRunner(GraphRunner):
    """Runs the forward as-is every time (the reference)."""

    def capture(self, sizes: list[int], device: torch.device) -> None:
        return None

    def can_replay(self, num_tokens: int) -> bool:
        return False

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids, positions)


# (mode, platform) -> "module:Class"; "*" matches any platform. Modules are imported on first use.
# ``partial`` on a platform with device graphs captures the pieces between attention calls
# (``graph/piecewise.py``); elsewhere inductor compiles them (``graph/partial.py``). ``full``
# (``graph/full.py``: whole decode steps as device graphs, the rest piecewise) needs an attention op
# that reads its metadata from device buffers only: CUDA has one in Triton (``ops/triton_kernels``).
_RUNNERS: dict[tuple[str, str], str] = {
    ("partial", "*"): "graph.partial:PartialGraphRunner",
    ("partial", "cuda"): "graph.piecewise:PiecewiseGraphRunner",
    ("partial", "npu"): "graph.piecewise:PiecewiseGraphRunner",
    ("full", "cuda"): "graph.full:FullGraphRunner",
}


def register_graph_runner(mode: str, platform_name: str, target: str) -> None:
    """Register ``"module:Class"`` (a ``GraphRunner`` taking the forward) for ``mode`` on a platform."""
    _RUNNERS[(mode, platform_name)] = target


def graph_modes(platform_name: str) -> list[str]:
    """The modes available on a platform."""
    return ["eager"] + sorted({m for (m, p) in _RUNNERS if p in (platform_name, "*")})


def create_graph_runner(mode: str, platform_name: str, forward: Forward) -> GraphRunner:
    """The graph runner of ``mode`` for ``platform_name``; ``ValueError`` when the platform lacks it."""
    if mode == "eager":
        return EagerGraphRunner(forward)
    target = _RUNNERS.get((mode, platform_name)) or _RUNNERS.get((mode, "*"))
    if target is None:
        raise ValueError(
            f"graph mode {mode!r} is not available on {platform_name}; choose one of "
            f"{', '.join(graph_modes(platform_name))}"
        )
    module, _, name = target.partition(":")
    cls: Any = getattr(importlib.import_module(module), name)
    return cls(forward)
