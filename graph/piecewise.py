"""Piecewise device graphs: the token work between two attention calls captured as a device graph
(CUDA graph, ACLGraph on the NPU), one set per token-count bucket; attention runs eagerly between.

Attention's per-step metadata cannot be baked into a graph; everything else can (the xLLM report's
partial graph mode, §4.2). ``torch.compile`` traces ``forward_tokens`` per bucket with attention as
the opaque ``xllm::attention`` op; the traced graph is split at every attention call
(``split_at_attention``) and each piece is a ``GraphPiece``: captured once on persistent input
buffers, then replayed after copying in the arguments that change (never the weights). All buckets
share one graph memory pool, largest first. See ``docs/engine_performance.md``, "Graph mode".
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from graph.partial import PartialGraphRunner
from ops.platforms.device_graph import DeviceGraphs

logger = logging.getLogger(__name__)

ATTENTION_OP = "xllm.attention"


def is_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and ATTENTION_OP in str(node.target)


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """``gm`` split into submodules: each attention call alone, the work between two of them together.
    Returns the split module and the names of its piece submodules and attention submodules."""
    part = 0
    partition: dict[torch.fx.Node, int] = {}
    attention_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention(node):
            part += 1
            attention_parts.add(part)
            partition[node] = part
            part += 1
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in partition:
            partition[node] = partition[node.args[0]]  # an output of a split op stays with it
        else:
            partition[node] = part
    split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces, attentions = [], []
    for name, _ in split.named_children():
        (attentions if int(name.rsplit("_", 1)[1]) in attention_parts else pieces).append(name)
    return split, pieces, attentions


class GraphPiece:
    """One piece of one bucket: runs eagerly at first call, then replays its captured device graph."""

    def __init__(self, fn: Callable[..., Any], graphs: DeviceGraphs, pool: Any, compile_piece: bool) -> None:
        self.fn = fn
        self.graphs = graphs
        self.pool = pool
        self.compile_piece = compile_piece
        self.graph: Any = None
        self.static_args: list[Any] = []
        self.refresh: list[int] = []  # argument positions copied in before each replay
        self.out: Any = None

    def __call__(self, *args: Any) -> Any:
        if self.graph is None:
            return self._capture(args)
        for i in self.refresh:
            self.static_args[i].copy_(args[i])
        self.graph.replay()
        return self.out

    def _capture(self, args: tuple[Any, ...]) -> Any:
        if self.compile_piece:
            from torch._inductor.compile_fx import compile_fx

            self.fn = compile_fx(self.fn, list(args))
        self.fn(*args)  # warm-up outside the graph: kernels compiled, workspaces allocated
        self.static_args = list(args)
        for i, a in enumerate(args):
            # weights are graph inputs marked static by dynamo: their address never changes
            if isinstance(a, torch.Tensor) and not _is_static(a):
                self.static_args[i] = a.clone()
                self.refresh.append(i)
        self.graph, self.out = self.graphs.capture(lambda: self.fn(*self.static_args), self.pool)
        self.graph.replay()
        return self.out


def _is_static(t: torch.Tensor) -> bool:
    from torch._dynamo.utils import get_static_address_type

    return isinstance(t, torch.nn.Parameter) or get_static_address_type(t) is not None


class PiecewiseGraphRunner(PartialGraphRunner):
    """``partial`` graph mode on platforms with device graphs (``Platform.device_graphs()``)."""

    mode = "partial"

    def __init__(self, forward: Callable[..., torch.Tensor], graphs: DeviceGraphs | None = None) -> None:
        super().__init__(forward)
        self._graphs = graphs
        self._pool: Any = None
        self.num_pieces = 0  # pieces captured, all buckets

    def capture(self, sizes: list[int], device: torch.device) -> None:
        if self._graphs is None:
            from ops.platforms import current_platform

            self._graphs = current_platform().device_graphs()
        self._pool = self._graphs.new_pool()
        super().capture(sizes, device)
        logger.info("%d graph pieces captured (attention eager between them)", self.num_pieces)

    @property
    def device_graphs(self) -> tuple[DeviceGraphs | None, Any]:
        """The device-graph factory and memory pool its pieces were captured into (full graphs of
        whole decode steps share them: ``graph/full.py``)."""
        return self._graphs, self._pool

    def _capture_order(self, buckets: list[int]) -> list[int]:
        return buckets[::-1]  # the largest first: the smaller buckets' graphs reuse its pool memory

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        assert self._graphs is not None
        self.stats.num_compiles += 1
        if self._warm:
            self.stats.num_recompiles_after_warmup += 1
            logger.warning(
                "piecewise graph recompiled after warm-up (%d so far)", self.stats.num_recompiles_after_warmup
            )
        split, pieces, _ = split_at_attention(gm)
        for name in pieces:
            piece = GraphPiece(getattr(split, name), self._graphs, self._pool, self._graphs.compiles_pieces)
            setattr(split, name, _PieceModule(piece))
        self.num_pieces += len(pieces)
        return split

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().replay(input_ids, positions).clone()


class _PieceModule(torch.nn.Module):
    """A ``GraphPiece`` where ``split_module`` expects a submodule."""

    def __init__(self, piece: GraphPiece) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, *args: Any) -> Any:
        return self.piece(*args)
