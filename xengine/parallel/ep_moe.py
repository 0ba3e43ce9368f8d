"""Expert-parallel MoE: each rank holds some experts; tokens travel to them by all-to-all and back.

Attention and dense layers run replicated, so after the router every rank holds every token. Each
rank takes its slice of the step's real tokens, maps each (token, slot) pair to a physical expert slot
(EPLB replicas round-robin by position), dispatches the rows with one ``all_to_all_single``, runs its
local experts, combines the outputs with the reverse all-to-all and the routing weights, and an
``all_gather`` puts the slices together. Dual-batch overlap interleaves two micro-batches so one's
all-to-all overlaps the other's compute (``CommStats``: the time still blocked). Inside a compiled
graph the layer is one opaque custom op. See ``docs/expert_parallel.md``.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from graph.forward_context import get_forward_context
from ops import moe
from ops.moe import DispatchedTokens
from ops.opaque_op import opaque_op
from xengine.parallel.eplb_policy import initial_placement
from xengine.parallel.state import ExpertParallel, get_expert_parallel
from xengine.parallel.tensor import get_tensor_parallel
from xengine.parallel.tp_moe import tp_experts

Stage = Generator[Any, None, torch.Tensor]  # yields async work handles, returns the micro-batch output


class ExpertShard:
    """One MoE layer's share of experts on this rank: which logical expert each local slot holds, the
    logical -> physical routing table, load counters and (EPLB) the host copy of every expert."""

    def __init__(
        self, ep: ExpertParallel, num_experts: int, hidden_size: int, intermediate_size: int
    ) -> None:
        self.ep = ep
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.num_ranks = ep.world_size
        placement = initial_placement(1, num_experts, ep.world_size, ep.num_redundant)
        self.num_slots = placement.slots_per_rank
        self.num_physical = placement.num_physical
        self.layer_index = ep.register_layer(self)
        self.module: Any = None  # the FusedExperts holding the active weights (set by it)
        self.host: dict[str, torch.Tensor] = {}  # EPLB: every expert's weights, the swap's source
        self.standby: dict[str, torch.Tensor] = {}  # EPLB: the double buffer's other half
        self.set_placement(placement.phy_to_log[0])
        # per step of the window: tokens per logical expert, tokens per rank (this rank's slice)
        self.expert_load = torch.zeros(ep.window, num_experts, dtype=torch.int64, device="cpu")
        self.rank_load = torch.zeros(ep.window, ep.world_size, dtype=torch.int64, device="cpu")

    def set_placement(self, phy_to_log: tuple[int, ...]) -> None:
        """Route by ``phy_to_log`` (physical slot -> logical expert) from now on."""
        self.phy_to_log = tuple(phy_to_log)
        start = self.ep.rank * self.num_slots
        self.local = self.phy_to_log[start : start + self.num_slots]
        replicas: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.phy_to_log):
            replicas[expert].append(slot)
        width = max(len(r) for r in replicas)
        # host tensors, also while the model is built on the meta device
        self.replica_count = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device="cpu")
        self.replica_table = torch.tensor(
            [r + [r[0]] * (width - len(r)) for r in replicas], dtype=torch.int64, device="cpu"
        )

    def to_device(self, device: torch.device) -> None:
        """Routing tables and load counters next to the tokens (built on the host, with the model)."""
        if self.replica_table.device != device:
            self.replica_table = self.replica_table.to(device)
            self.replica_count = self.replica_count.to(device)
            self.expert_load = self.expert_load.to(device)
            self.rank_load = self.rank_load.to(device)

    def needs(self, expert: int) -> bool:
        """Whether loading reads ``expert``'s weights here: a local slot holds it, or EPLB keeps every
        expert on the host (a rank skips the rest without reading them)."""
        return self.ep.eplb is not None or expert in self.local

    def load(self, expert: int, param_name: str, part: int, rows: int, tensor: torch.Tensor) -> list[int]:
        """A checkpoint piece of ``expert``: the local slots to copy it into (EPLB also keeps it on the host)."""
        if self.ep.eplb is not None:
            host = self.host.get(param_name)
            if host is None:
                param = getattr(self.module, param_name)
                host = self.host[param_name] = torch.empty(
                    (self.num_experts, *param.shape[1:]), dtype=param.dtype, device="cpu"
                )
            host[expert, part * rows : (part + 1) * rows].copy_(tensor)
        return [slot for slot, logical in enumerate(self.local) if logical == expert]

    def to_physical(self, topk_ids: torch.Tensor, first_token: int) -> torch.Tensor:
        """Logical expert ids ``[t, k]`` -> physical slots, replicas taken round-robin by token."""
        self.to_device(topk_ids.device)
        if int(self.replica_table.shape[1]) == 1:
            return self.replica_table[topk_ids, 0]
        t, k = topk_ids.shape
        dev = topk_ids.device
        # token + slot: consecutive tokens alternate replicas whatever slot the expert was chosen in
        spread = torch.arange(first_token, first_token + t, device=dev).unsqueeze(1) + torch.arange(
            k, device=dev
        )
        return self.replica_table[topk_ids, spread % self.replica_count[topk_ids]]


def ep_fused_experts(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_index: int
) -> torch.Tensor:
    """The expert part of MoE layer ``layer_index`` across the expert-parallel group."""
    if torch.compiler.is_compiling():
        return _ep_op(hidden, topk_weights, topk_ids, layer_index)
    return _ep_forward(hidden, topk_weights, topk_ids, layer_index)


def _ep_forward(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_index: int
) -> torch.Tensor:
    ep = get_expert_parallel()
    assert ep is not None, "an expert-parallel layer ran without the expert-parallel group"
    ctx = get_forward_context()
    if ctx is None or ctx.meta is None:  # graph capture / warm-up: no collectives, nothing real to compute
        return torch.zeros_like(hidden)
    shard = ep.layers[layer_index]
    tp = get_tensor_parallel()
    if tp is not None and ep.eplb is None and not ep.dual_batch_overlap:  # tokens on every rank already
        return tp_experts(ep, tp, shard, hidden, topk_weights, topk_ids)
    num_real = min(ctx.num_tokens, hidden.shape[0])
    if ep.data_parallel:  # this rank's own tokens (data-parallel attention): all of them, no gather
        return _own_tokens(ep, shard, hidden, topk_weights, topk_ids, num_real)
    bounds = [num_real * r // ep.world_size for r in range(ep.world_size + 1)]
    lo, hi = bounds[ep.rank], bounds[ep.rank + 1]
    args = (hidden[lo:hi], topk_weights[lo:hi], topk_ids[lo:hi])
    ep.comm.num_layer_calls += 1
    if ep.dual_batch_overlap and num_real >= 2 * ep.world_size:  # the same choice on every rank
        mid = lo + (hi - lo) // 2
        a = _micro_batch(ep, shard, *(x[: mid - lo] for x in args), lo)
        b = _micro_batch(ep, shard, *(x[mid - lo :] for x in args), mid)
        local = torch.cat(_interleave(ep, [a, b]))
    else:
        (local,) = _interleave(ep, [_micro_batch(ep, shard, *args, lo)])
    out = _all_gather(ep, local.to(hidden.dtype), bounds)
    if num_real < hidden.shape[0]:
        out = torch.cat([out, hidden.new_zeros(hidden.shape[0] - num_real, hidden.shape[1])])
    return out


def _own_tokens(
    ep: ExpertParallel,
    shard: ExpertShard,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_real: int,
) -> torch.Tensor:
    """Data-parallel attention: every rank dispatches its own ``num_real`` tokens (padding dropped)."""
    ep.comm.num_layer_calls += 1
    args = (hidden[:num_real], topk_weights[:num_real], topk_ids[:num_real])
    (out,) = _interleave(ep, [_micro_batch(ep, shard, *args, 0)])
    out = out.to(hidden.dtype)
    if num_real < hidden.shape[0]:
        out = torch.cat([out, hidden.new_zeros(hidden.shape[0] - num_real, hidden.shape[1])])
    return out


def idle_exchange(ep: ExpertParallel) -> None:
    """A data-parallel rank without a batch while others run a forward: every MoE layer's exchange,
    in model order, with no tokens of its own (its experts still serve the others' tokens)."""
    for shard in ep.layers:
        device = shard.module.down_proj.device
        hidden = torch.zeros(0, shard.hidden_size, dtype=ep.act_dtype, device=device)
        ids = torch.zeros(0, 1, dtype=torch.int64, device=device)
        ep.comm.num_layer_calls += 1
        _interleave(ep, [_micro_batch(ep, shard, hidden, ids.to(hidden.dtype), ids, 0)])


def _micro_batch(
    ep: ExpertParallel,
    shard: ExpertShard,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_token: int,
) -> Stage:
    """Dispatch -> local experts -> combine for one micro-batch; yields at each collective in flight."""
    n, s = ep.world_size, shard.num_slots
    num_tokens, top_k = topk_ids.shape
    phys = shard.to_physical(topk_ids, first_token).reshape(-1)
    order = torch.argsort(phys, stable=True)
    per_slot = torch.bincount(phys, minlength=shard.num_physical)
    _count(ep, shard, topk_ids, per_slot)
    send_rows = hidden[order // top_k]
    equal = [s] * n
    recv_per_slot = yield from _exchange(ep, per_slot, equal, equal)
    recv_per_slot = recv_per_slot.view(n, s)
    send_splits = per_slot.view(n, s).sum(1).tolist()
    recv_splits = recv_per_slot.sum(1).tolist()
    recv_rows = yield from _exchange(ep, send_rows, send_splits, recv_splits)
    ep.comm.bytes_sent += send_rows.numel() * send_rows.element_size()
    # rows arrive source-major, slot-minor: group them by local slot for the grouped matmul
    slot_of_row = torch.arange(s, device=recv_per_slot.device).repeat(n)
    slot_of_row = slot_of_row.repeat_interleave(recv_per_slot.reshape(-1))
    perm = torch.argsort(slot_of_row, stable=True)
    module = shard.module
    out = moe.expert_swiglu(
        recv_rows[perm], recv_per_slot.sum(0).tolist(), module.gate_up_proj, module.down_proj
    )
    back = torch.empty_like(out)
    back[perm] = out
    returned = yield from _exchange(ep, back, recv_splits, send_splits)
    dispatched = DispatchedTokens(returned, [], order, num_tokens, top_k)
    return moe.combine(returned, dispatched, topk_weights)


def _exchange(
    ep: ExpertParallel, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
) -> Stage:
    """One all-to-all of rows: through shared memory where the ranks share a host (synchronous: no
    overlap to gain on CPU), else ``all_to_all_single`` on the group, yielded while in flight."""
    if ep.a2a is not None and not ep.dual_batch_overlap:
        t0 = time.perf_counter()
        recv = ep.a2a.all_to_all(send.contiguous(), send_splits, recv_splits)
        ep.comm.exposed_s += time.perf_counter() - t0
        return recv
    recv = send.new_empty(sum(recv_splits), *send.shape[1:])
    yield dist.all_to_all_single(recv, send, recv_splits, send_splits, group=ep.group, async_op=True)
    return recv


def _interleave(ep: ExpertParallel, stages: list[Stage]) -> list[torch.Tensor]:
    """Run micro-batch generators round-robin: each runs until it has a collective in flight, then the
    next one computes while it travels. Time spent blocked in ``wait`` is the exposed communication."""
    results: list[torch.Tensor | None] = [None] * len(stages)
    pending: list[Any] = [None] * len(stages)
    live = list(range(len(stages)))
    while live:
        for i in list(live):
            if pending[i] is not None:
                t0 = time.perf_counter()
                pending[i].wait()
                ep.comm.exposed_s += time.perf_counter() - t0
            try:
                pending[i] = next(stages[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return [r for r in results if r is not None]


def _all_gather(ep: ExpertParallel, local: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Every rank's slice (uneven sizes: padded to the largest) -> the whole ``[num_real, H]``."""
    sizes = [bounds[r + 1] - bounds[r] for r in range(ep.world_size)]
    width = max(sizes)
    padded = (
        local
        if local.shape[0] == width
        else torch.cat([local, local.new_zeros(width - local.shape[0], local.shape[1])])
    )
    t0 = time.perf_counter()
    if ep.a2a is not None:
        parts = list(ep.a2a.all_gather(padded.contiguous().unsqueeze(0), dim=0).unbind(0))
    else:
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=ep.group)
    ep.comm.exposed_s += time.perf_counter() - t0
    return torch.cat([p[:size] for p, size in zip(parts, sizes)])


def _count(ep: ExpertParallel, shard: ExpertShard, topk_ids: torch.Tensor, per_slot: torch.Tensor) -> None:
    """This step's load: tokens per logical expert and per rank (this rank's slice; all-reduced on demand)."""
    row = ep.step_index % ep.window
    shard.expert_load[row] += torch.bincount(topk_ids.reshape(-1), minlength=shard.num_experts)
    shard.rank_load[row] += per_slot.view(ep.world_size, -1).sum(1)


def _ep_fake(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_index: int
) -> torch.Tensor:
    return torch.empty_like(hidden)


@opaque_op(
    "ep_fused_experts(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int layer_index) -> Tensor",
    _ep_fake,
)
def _ep_op(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_index: int
) -> torch.Tensor:
    return _ep_forward(hidden, topk_weights, topk_ids, layer_index)
