"""EPLB at run time: load counters over a window, rebalancing, and the double-buffered weight swap.

Rank 0 chooses each step's action and broadcasts it with the inputs, so all ranks run the same
collectives: ``STATS`` / ``REBALANCE`` all-reduce the load counters (``REBALANCE`` then runs the pure
policy, ``eplb_policy.rebalance``, on every rank: the same numbers give the same placement, and a
background thread loads it into each layer's standby buffer); ``SWITCH_CHECK`` all-reduces "ready",
and once every rank is, all swap buffers and routing tables at that step boundary (references only:
nothing copied on the critical path). See ``docs/expert_parallel.md``.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist

from ops.platforms import current_platform
from xengine.parallel.eplb_policy import (
    Placement,
    balancedness,
    expected_physical_load,
    rank_loads,
    rebalance,
)
from xengine.parallel.state import ExpertParallel

logger = logging.getLogger("xengine.eplb")

NONE, STATS, REBALANCE, SWITCH_CHECK = 0, 1, 2, 3
STATS_INTERVAL = 8  # steps between two balancedness measurements (one small all-reduce)
MIN_GAIN = 0.02  # predicted mean balancedness a new placement must add to be worth a swap


class Eplb:
    def __init__(self, ep: ExpertParallel, interval: int) -> None:
        self.ep = ep
        self.interval = interval
        self.pending: Placement | None = None
        self._ready = threading.Event()
        self._loader: threading.Thread | None = None
        self.balancedness: list[float] = []  # per MoE layer, over the last window (all ranks' tokens)
        self.balancedness_before: list[float] = []  # at the last rebalancing decision
        self.num_swaps = 0
        self.last_swap_s = 0.0  # the switch at the step boundary
        self.last_load_s = 0.0  # the background copy into the standby buffers

    def action_for(self, step_index: int) -> int:
        """Rank 0: what every rank does before step ``step_index``'s forward."""
        if self.pending is not None:
            return SWITCH_CHECK
        if step_index % self.interval == 0:
            return REBALANCE
        return STATS if step_index % STATS_INTERVAL == 0 else NONE

    def run(self, action: int) -> None:
        """Every rank, before the forward of a step whose action is ``action``."""
        if action in (STATS, REBALANCE):
            expert_load, rank_load = self._reduce()
            self.balancedness = [balancedness(r) for r in rank_load]
            if action == REBALANCE:
                self._decide(expert_load)
        elif action == SWITCH_CHECK:
            device = self.ep.layers[0].rank_load.device  # the data group's device (nccl: the GPU)
            flag = torch.tensor([1 if self._ready.is_set() else 0], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.ep.group)
            if int(flag.item()):
                self._switch()

    def _reduce(self) -> tuple[list[list[float]], list[list[float]]]:
        layers = self.ep.layers
        num_experts = layers[0].num_experts
        local = torch.cat([torch.cat([s.expert_load.sum(0), s.rank_load.sum(0)]) for s in layers]).to(
            torch.float64
        )
        dist.all_reduce(local, group=self.ep.group)
        rows = local.view(len(layers), -1)
        return rows[:, :num_experts].tolist(), rows[:, num_experts:].tolist()

    def _decide(self, expert_load: list[list[float]]) -> None:
        if not any(any(row) for row in expert_load):
            return
        ep = self.ep
        placement = rebalance(expert_load, ep.world_size, ep.num_redundant)
        current = Placement(tuple(s.phy_to_log for s in ep.layers), ep.world_size, ep.layers[0].num_experts)
        gain = _predicted(placement, expert_load) - _predicted(current, expert_load)
        if gain < MIN_GAIN:  # not worth moving weights (and no churn on noise)
            return
        self.balancedness_before = list(self.balancedness)
        self.pending = placement
        self._ready.clear()
        self._loader = threading.Thread(target=self._load, args=(placement,), name="eplb-load", daemon=True)
        self._loader.start()

    def _load(self, placement: Placement) -> None:
        """Background: the new placement's weights into every layer's standby buffer (host -> device)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i, shard in enumerate(self.ep.layers):
                local = placement.local_logical(i, self.ep.rank)
                for name in ("gate_up_proj", "down_proj"):
                    standby = shard.standby.get(name)
                    if standby is None:
                        standby = shard.standby[name] = torch.empty_like(getattr(shard.module, name))
                    idx = torch.tensor(local, dtype=torch.int64)
                    standby.copy_(shard.host[name].index_select(0, idx), non_blocking=True)
        current_platform().synchronize()  # the copies are done before the ranks agree to switch
        self.last_load_s = time.perf_counter() - t0
        self._ready.set()

    def _switch(self) -> None:
        """At a step boundary, on every rank at once: standby becomes active, routing follows."""
        t0 = time.perf_counter()
        placement = self.pending
        assert placement is not None
        for i, shard in enumerate(self.ep.layers):
            module = shard.module
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(module, name)
                active = param.data
                param.data = shard.standby[name]
                shard.standby[name] = active
            device = shard.replica_table.device
            shard.set_placement(placement.phy_to_log[i])
            shard.to_device(device)
            shard.rank_load.zero_()  # balancedness from here on measures the new placement
        self.pending = None
        self._ready.clear()
        self.num_swaps += 1
        self.last_swap_s = time.perf_counter() - t0
        logger.info(
            "EPLB: new expert placement active (swap %d, %.1f ms; background load %.1f ms)",
            self.num_swaps,
            self.last_swap_s * 1e3,
            self.last_load_s * 1e3,
        )


def _predicted(placement: Placement, expert_load: list[list[float]]) -> float:
    """Mean over layers of the balancedness ``placement`` would give ``expert_load`` (replicas share evenly)."""
    values = [
        balancedness(rank_loads(placement, i, expected_physical_load(placement, i, load)))
        for i, load in enumerate(expert_load)
    ]
    return sum(values) / len(values)
