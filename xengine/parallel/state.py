"""Expert-parallel state of this process: rank, groups, and the MoE layers (``ExpertShard``) built on it.

Set once at start-up (before the model is built, so ``FusedExperts`` knows which experts to hold) by
the engine (rank 0) or a worker (ranks 1..N-1); ``None`` in a single-process engine. A module-level
handle as vLLM's ``get_ep_group()``, because layers are built deep inside model constructors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CommStats:
    """Time this rank spent blocked on MoE communication (what overlap did not hide)."""

    exposed_s: float = 0.0  # waiting on all-to-all / all-gather, summed over every MoE layer
    num_steps: int = 0
    num_layer_calls: int = 0
    bytes_sent: int = 0


@dataclass
class ExpertParallel:
    rank: int
    world_size: int
    group: Any  # torch.distributed group of the MoE collectives (all-to-all, all-gather)
    control_group: Any  # the step broadcasts and EPLB agreement (no timeout: workers wait while idle)
    dual_batch_overlap: bool = False
    data_parallel: bool = False  # every rank has its own tokens (data-parallel attention): no slicing
    a2a: Any = None  # ``ShmCommunicator`` for the MoE exchanges when every rank shares this host (gloo)
    act_dtype: Any = None  # the model's activation dtype (an idle data-parallel rank's empty rows)
    num_redundant: int = 0  # EPLB's extra expert slots across all ranks
    window: int = 1  # steps of load history each layer keeps
    eplb: Any = None  # ``xengine.parallel.eplb.Eplb`` when EPLB is on (it imports this module)
    comm: CommStats = field(default_factory=CommStats)
    step_index: int = 0
    layers: list[Any] = field(default_factory=list)  # the FusedExperts of each MoE layer, in order

    def register_layer(self, layer: Any) -> int:
        """A new MoE layer (built in model order, the same on every rank) -> its MoE layer index."""
        self.layers.append(layer)
        return len(self.layers) - 1

    def begin_step(self, step_index: int, eplb_action: int) -> None:
        """Every rank, before a step's forward: open this step's row of the load window, then run the
        EPLB action rank 0 chose for it (collectives, in the same order everywhere)."""
        self.step_index = step_index
        row = step_index % self.window
        for shard in self.layers:
            shard.expert_load[row].zero_()
            shard.rank_load[row].zero_()
        self.comm.num_steps += 1
        if self.eplb is not None and eplb_action:
            self.eplb.run(eplb_action)


_current: ExpertParallel | None = None


def set_expert_parallel(ep: ExpertParallel | None) -> None:
    global _current
    _current = ep


def get_expert_parallel() -> ExpertParallel | None:
    return _current
