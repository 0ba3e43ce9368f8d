"""The ``parallel`` section: how one engine instance splits over processes (tensor, expert and
data-parallel ranks; ``xengine/parallel/`` runs it).

Torch-free, like ``config.py``, whose ``EngineConfig`` holds it."""

from __future__ import annotations

from dataclasses import dataclass

from xengine.api.config_fields import _f


@dataclass(frozen=True)
class ParallelConfig:
    expert_parallel_size: int = _f(
        1,
        "Worker processes of one engine instance for MoE models (expert parallel): experts are sharded across "
        "them and tokens move by all-to-all dispatch/combine over torch.distributed (gloo on CPU, nccl / hccl "
        "on devices); attention and dense layers run replicated. 1: one process.",
    )
    tensor_parallel_size: int = _f(
        1,
        "Processes one engine instance's attention and dense layers split over (tensor parallel): "
        "column-parallel QKV and gate/up, row-parallel o_proj and down with one all-reduce each, "
        "vocab-parallel embedding and LM head, each rank holding its heads' KV. Ranks on one host "
        "all-reduce through shared memory. MoE experts split over the same ranks by expert parallelism "
        "(expert_parallel_size must be 1 or equal). 1: one process.",
    )
    data_parallel_size: int = _f(
        1,
        "Engine processes of one instance that each own their requests, KV cache and attention "
        "(data-parallel attention for MoE models): their MoE layers exchange tokens by all-to-all, the "
        "experts split over all of them (expert_parallel_size must be 1 or equal), and they step in "
        "lock-step (a rank without a batch runs only its share of the expert exchange). The service starts "
        "them together, routes each request to the least-loaded one and relaunches them together. 1: off.",
    )
    data_parallel_rank: int = _f(
        0, "This engine process's data-parallel rank (set by the service for each process it starts)."
    )
    data_parallel_address: str = _f(
        "",
        "The data-parallel ranks' rendezvous, tcp://HOST:PORT (set by the service; '' with "
        "data_parallel_size 1).",
    )
    distributed_executor_backend: str = _f(
        "mp",
        "How the instance's ranks 1..N-1 start: 'mp' (processes on this host, all-reduce through shared "
        "memory) or 'ray' (Ray actors in a placement group, one bundle per rank, possibly on other nodes; "
        "rendezvous over TCP, gloo between hosts).",
    )
    ray_address: str = _f(
        "", "ray executor: the Ray cluster to join ('' : the one this process is connected to, or 'auto')."
    )
    placement_strategy: str = _f(
        "SPREAD",
        "ray executor: the placement group's strategy (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD; "
        "STRICT_SPREAD puts every rank on its own node).",
    )
    enable_dual_batch_overlap: bool = _f(
        False,
        "Split each MoE layer's tokens into two micro-batches so one's all-to-all is in flight while the other "
        "computes its experts (needs expert_parallel_size > 1). Off by default: on CPU (gloo) it did not "
        "measure faster (benchmarks/moe_ep.py).",
    )
    enable_eplb: bool = _f(
        False,
        "Expert-parallel load balancing: count tokens per physical expert, periodically compute a new "
        "placement (replicating hot experts) and swap expert weights through a double buffer at one step "
        "boundary on all ranks (needs expert_parallel_size > 1).",
    )
    num_redundant_experts: int = _f(
        0,
        "Extra expert slots (replicas of hot experts) across all ranks; experts + these must divide evenly.",
    )
    eplb_interval: int = _f(200, "Steps between two rebalancing decisions (EPLB).")
    eplb_window: int = _f(100, "Steps of expert-load history a rebalancing decision looks at (EPLB).")

    @property
    def world_size(self) -> int:
        """Processes of the instance: the tensor-parallel ranks, which also split the experts, or the
        data-parallel ranks."""
        return max(self.tensor_parallel_size, self.expert_parallel_size, self.data_parallel_size)

    def validate(self) -> None:
        if self.expert_parallel_size < 1:
            raise ValueError("parallel.expert_parallel_size must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("parallel.tensor_parallel_size must be >= 1")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp > 1 and ep not in (1, tp):
            raise ValueError(
                f"parallel.expert_parallel_size ({ep}) must be 1 or equal tensor_parallel_size ({tp}): "
                "experts are split over the tensor-parallel ranks"
            )
        self._validate_data_parallel()
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"parallel.distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}"
            )
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                "parallel.placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got "
                f"{self.placement_strategy!r}"
            )
        if self.num_redundant_experts < 0:
            raise ValueError("parallel.num_redundant_experts must be >= 0")
        if self.eplb_interval < 1 or self.eplb_window < 1:
            raise ValueError("parallel.eplb_interval and parallel.eplb_window must be >= 1")
        single = self.world_size == 1
        for flag, on in (
            ("enable_dual_batch_overlap", self.enable_dual_batch_overlap),
            ("enable_eplb", self.enable_eplb),
            ("num_redundant_experts", self.num_redundant_experts > 0),
        ):
            if on and single:
                raise ValueError(
                    f"parallel.{flag} needs expert_parallel_size > 1 (set --expert-parallel-size)"
                )
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("parallel.num_redundant_experts needs enable_eplb (--enable-eplb)")

    def _validate_data_parallel(self) -> None:
        dp, ep = self.data_parallel_size, self.expert_parallel_size
        if dp < 1:
            raise ValueError("parallel.data_parallel_size must be >= 1")
        if not 0 <= self.data_parallel_rank < dp:
            raise ValueError(
                f"parallel.data_parallel_rank must be in [0, {dp}), got {self.data_parallel_rank}"
            )
        if dp == 1:
            return
        if ep not in (1, dp):
            raise ValueError(
                f"parallel.expert_parallel_size ({ep}) must be 1 or equal data_parallel_size ({dp}): the "
                "experts are split over the data-parallel ranks"
            )
        for flag, on in (
            ("tensor_parallel_size > 1", self.tensor_parallel_size > 1),
            ("enable_dual_batch_overlap", self.enable_dual_batch_overlap),
            ("enable_eplb", self.enable_eplb),
            ("distributed_executor_backend ray", self.distributed_executor_backend == "ray"),
        ):
            if on:
                raise ValueError(
                    f"parallel.{flag} is not supported with data_parallel_size > 1 yet; use one or the other"
                )
