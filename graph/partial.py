"""Partial graph mode: everything but attention compiled, one graph per token-count bucket.

``torch.compile`` (inductor; C++/OpenMP kernels on CPU) traces ``forward_tokens`` with attention as
the opaque ``xllm::attention`` op, so norms, projections, RoPE, activations and residuals of every
layer become fused kernels around eager attention calls. Shapes are static per bucket: a step of
``n`` tokens is padded to the smallest bucket ``>= n`` (padding rows are neither attended nor
written to the KV cache, and are dropped from the output); a step longer than the largest bucket
runs eagerly. Every bucket is compiled at start-up (``capture``); a compilation after that is counted
as a recompilation (it means a guard failed) and reported in the engine stats.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from graph.base import Forward, GraphRunner
from graph.forward_context import forward_context

logger = logging.getLogger(__name__)


class PartialGraphRunner(GraphRunner):
    mode = "partial"

    def __init__(self, forward: Forward) -> None:
        super().__init__(forward)
        self._compiled: Any = None
        self._warm = False

    def capture(self, sizes: list[int], device: torch.device) -> None:
        import torch._dynamo

        buckets = sorted(set(sizes))
        config = torch._dynamo.config
        for attr in ("recompile_limit", "cache_size_limit"):  # room for one more graph per bucket
            if hasattr(config, attr):  # (process-wide: every engine of the process adds its own)
                setattr(config, attr, getattr(config, attr) + len(buckets))
        with (
            forward_context(None, [], 1),
            torch.inference_mode(),
        ):  # lazy state (e.g. RoPE tables) built eagerly
            one = torch.zeros(1, dtype=torch.long, device=device)
            self.forward(one, one.clone())
        self._compiled = torch.compile(self.forward, backend=self._backend, dynamic=False, fullgraph=True)
        self.stats.buckets = buckets
        total = time.perf_counter()
        for size in self._capture_order(buckets):
            t0 = time.perf_counter()
            with forward_context(None, [], size), torch.inference_mode():  # as the runner calls it
                ids = torch.zeros(size, dtype=torch.long, device=device)
                positions = torch.zeros(size, dtype=torch.long, device=device)
                self._compiled(ids, positions)
            self.stats.capture_s[size] = round(time.perf_counter() - t0, 3)
        self._warm = True
        logger.info(
            "partial graphs compiled for %d token-count buckets %s in %.1fs",
            len(buckets), buckets, time.perf_counter() - total,
        )  # fmt: skip

    def _capture_order(self, buckets: list[int]) -> list[int]:
        return buckets

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.stats.num_compiles += 1
        if self._warm:
            self.stats.num_recompiles_after_warmup += 1
            logger.warning(
                "partial graph recompiled after warm-up (%d so far)", self.stats.num_recompiles_after_warmup
            )
        return compile_fx(gm, example_inputs)

    def can_replay(self, num_tokens: int) -> bool:
        return self._compiled is not None and num_tokens <= self.stats.buckets[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        bucket = self.stats.buckets[bisect.bisect_left(self.stats.buckets, n)]
        if bucket == n:
            return self._compiled(input_ids, positions)
        pad = bucket - n
        ids = torch.nn.functional.pad(input_ids, (0, pad))
        pos = torch.nn.functional.pad(positions, (0, pad))
        return self._compiled(ids, pos)[:n]
