"""Full graph mode: whole decode steps captured as device graphs, one per decode bucket.

A decode step of ``B`` sequences runs as one device graph, attention included (the xLLM report's
full-graph path, §4.2). Attention is capturable because each bucket is captured on static device
buffers read through ``meta.static`` metadata (``attention_static``: Triton on CUDA), which reads
nothing from the host; a replay copies the step's values into those buffers, and padding rows
(length 0, slot -1) read and write nothing. Every other step runs ``PiecewiseGraphRunner``
(``graph/piecewise.py``), as does a bucket whose capture fails.
See ``docs/engine_performance.md``, "Graph mode".
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graph.base import GraphRunner
from graph.forward_context import forward_context, get_forward_context
from graph.piecewise import PiecewiseGraphRunner
from ops.attention_metadata import AttentionMetadata
from ops.platforms.device_graph import DeviceGraphs, Graph

logger = logging.getLogger(__name__)


@dataclass
class _Buffers:
    """The static inputs every bucket's graph reads (bucket ``B`` reads the first ``B`` rows)."""

    input_ids: torch.Tensor  # int64 [max B]
    positions: torch.Tensor  # int64 [max B]
    seq_lens: torch.Tensor  # int32 [max B]
    block_tables: torch.Tensor  # int32 [max B, blocks per sequence]
    slot_mapping: torch.Tensor  # int64 [max B]

    def meta(self, batch: int, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=self.seq_lens.device),
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch],
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[],  # the host side describes no step: static attention must not read it
            max_query_len=1,
            max_seq_len=0,
            block_size=block_size,
            static=True,
        )


class FullGraphRunner(GraphRunner):
    mode = "full"

    def __init__(self, forward: Callable[..., torch.Tensor], graphs: DeviceGraphs | None = None) -> None:
        super().__init__(forward)
        self.piecewise = PiecewiseGraphRunner(forward, graphs)
        self._caches: list[Any] | None = None
        self._block_size = 0
        self._width = 0
        self._buffers: _Buffers | None = None
        self._graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.decode_buckets: list[int] = []

    def bind_kv(self, caches: list[Any], block_size: int, max_blocks_per_seq: int) -> None:
        if all(isinstance(c, torch.Tensor) for c in caches):
            self._caches, self._block_size, self._width = caches, block_size, max_blocks_per_seq
        else:
            logger.info("full graph mode needs the paged KV layout: every step runs piecewise graphs")

    def capture(self, sizes: list[int], device: torch.device) -> None:
        self.piecewise.capture(sizes, device)  # device graphs, compiled pieces, pool: shared below
        self.stats = self.piecewise.stats
        self.stats.mode = self.mode
        if self._caches is None:
            return
        buckets = sorted(set(sizes))
        top = buckets[-1]
        self._buffers = _Buffers(
            input_ids=torch.zeros(top, dtype=torch.long, device=device),
            positions=torch.zeros(top, dtype=torch.long, device=device),
            seq_lens=torch.zeros(top, dtype=torch.int32, device=device),
            block_tables=torch.zeros(top, self._width, dtype=torch.int32, device=device),
            slot_mapping=torch.full((top,), -1, dtype=torch.long, device=device),
        )
        total = time.perf_counter()
        for batch in buckets[::-1]:  # the largest first: the others reuse its pool memory
            t0 = time.perf_counter()
            try:
                self._graphs[batch] = self._capture(batch)
            except Exception as e:  # noqa: BLE001 - the bucket stays piecewise
                logger.warning("full graph for %d decodes not captured (%s); it runs piecewise", batch, e)
                continue
            self.stats.decode_graph_capture_s[batch] = round(time.perf_counter() - t0, 3)
        self.decode_buckets = self.stats.decode_graph_buckets = sorted(self._graphs)
        logger.info(
            "full decode graphs captured for %s sequences in %.1fs",
            self.decode_buckets, time.perf_counter() - total,
        )  # fmt: skip

    def _capture(self, batch: int) -> tuple[Graph, torch.Tensor]:
        graphs, pool = self.piecewise.device_graphs
        assert graphs is not None and self._buffers is not None and self._caches is not None
        bufs, caches, meta = self._buffers, self._caches, self._buffers.meta(batch, self._block_size)
        ids, positions = bufs.input_ids[:batch], bufs.positions[:batch]

        def step() -> torch.Tensor:  # the context is part of what is captured: the static one
            with forward_context(meta, caches, batch):
                return self.forward(ids, positions)

        with torch.inference_mode():  # as the engine runs its steps
            step()  # warm-up outside the graph (library handles, workspaces): all rows padding
            graphs.synchronize()
            return graphs.capture(step, pool)

    def can_replay(self, num_tokens: int) -> bool:
        return self.piecewise.can_replay(num_tokens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch = self._decode_bucket(input_ids.shape[0])
        if batch is None:
            return self.piecewise.run(input_ids, positions)
        self.stats.num_replays += 1
        self.stats.num_decode_graph_replays += 1
        return self.replay_full(batch, input_ids, positions)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.piecewise.replay(input_ids, positions)

    def _decode_bucket(self, n: int) -> int | None:
        """The full graph this step replays, or None (it runs piecewise)."""
        if not self.decode_buckets or n > self.decode_buckets[-1]:
            return None
        ctx = get_forward_context()
        if ctx is None or ctx.meta is None or ctx.interrupt is not None:
            return None
        meta = ctx.meta
        if meta.kv_slots is not None or meta.max_query_len != 1 or len(meta.query_lens_cpu) != n:
            return None
        if meta.block_tables.shape[1] > self._width:
            return None
        return self.decode_buckets[bisect.bisect_left(self.decode_buckets, n)]

    def replay_full(self, batch: int, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        assert ctx is not None and ctx.meta is not None and self._buffers is not None
        meta, bufs, n = ctx.meta, self._buffers, input_ids.shape[0]
        bufs.input_ids[:n].copy_(input_ids)
        bufs.positions[:n].copy_(positions)
        bufs.seq_lens[:n].copy_(meta.seq_lens)
        bufs.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        bufs.slot_mapping[:n].copy_(meta.slot_mapping)
        if batch > n:  # padding rows: no context, no KV write
            bufs.input_ids[n:batch].zero_()
            bufs.positions[n:batch].zero_()
            bufs.seq_lens[n:batch].zero_()
            bufs.slot_mapping[n:batch].fill_(-1)
        graph, out = self._graphs[batch]
        graph.replay()
        return out[:n].clone()  # the next replay overwrites the graph's output
