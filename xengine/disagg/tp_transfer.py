"""PD between instances with different tensor-parallel layouts: every rank moves its own KV heads.

A tensor-parallel instance's KV is split by heads over its ranks, so each rank has its own Mooncake
agent over its own pool. An export lists every rank's memory and heads (``KVExportInfo.ranks``); an
importing rank reads, from each source rank, the run of heads both hold, per token
(``memory/head_ranges.py``), into its blocks: rank 0 itself, and the workers when rank 0 asks them
over the group's control path. The block ids are rank 0's on every rank (one pool geometry), so a
pair of block ids means the same on all of them.

Rank 0 asks its workers with a control message (``KIND_KV_AGENT``: start your agent and report it;
``KIND_KV_READ``: read these heads into these blocks), then the request and the replies travel as
objects on the control group. Workers handle them between steps (``serve_worker_request``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from memory.head_ranges import RankKV, head_ranges
from memory.transfer import KVRegion, KVTransferAgent
from xengine.api.messages import KVRankRegionMsg
from xengine.parallel.step_message import publish_control

KIND_KV_AGENT, KIND_KV_READ = 4, 5


class RankTransfer:
    """This rank's agent over its KV pool and the heads it holds."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        first_head: int,
        num_heads: int,
        block_size: int,
        host: str = "127.0.0.1",
        port_range: tuple[int, int] | None = None,
        agent: KVTransferAgent | None = None,
    ) -> None:
        self.kv_caches, self.first_head, self.num_heads = kv_caches, first_head, num_heads
        self.block_size, self.host, self.port_range = block_size, host, port_range
        self.agent = agent

    def start(self) -> KVTransferAgent:
        if self.agent is None:
            self.agent = KVTransferAgent(self.kv_caches, self.host, self.port_range)
        return self.agent

    def region_msg(self) -> KVRankRegionMsg:
        r = self.start().region
        return KVRankRegionMsg(
            session=r.session, layer_addrs=list(r.layer_addrs), num_blocks=r.num_blocks,
            block_bytes=r.block_bytes, first_head=self.first_head, num_heads=self.num_heads,
        )  # fmt: skip

    def read(self, sources: list[KVRankRegionMsg], pairs: list[tuple[int, int]]) -> int:
        """Read this rank's heads of the ``(source block, own block)`` pairs; the bytes moved."""
        agent = self.start()
        mine = RankKV(agent.region, self.first_head, self.num_heads)
        moved = 0
        for session, src, dst, lengths in head_ranges(
            [_rank_kv(s) for s in sources], mine, pairs, self.block_size
        ):
            agent.read_ranges(session, src, dst, lengths)
            moved += sum(lengths)
        return moved


class GroupTransfer:
    """Rank 0's side: its own ``RankTransfer`` and the workers', driven over the control group."""

    def __init__(self, group: Any, channel: Any, mine: RankTransfer, total_heads: int) -> None:
        self.group, self.channel, self.mine, self.total_heads = group, channel, mine, total_heads
        self._regions: list[KVRankRegionMsg] | None = None

    def regions(self) -> list[KVRankRegionMsg]:
        """Every rank's memory and heads (the workers start their agents on the first call)."""
        if self._regions is None:
            publish_control(self.group, KIND_KV_AGENT, channel=self.channel)
            self._regions = _gather(self.group, self.mine.region_msg())
        return self._regions

    def read(self, sources: list[KVRankRegionMsg], pairs: list[tuple[int, int]]) -> int:
        """Every rank reads its heads of ``pairs``; the bytes moved over all ranks."""
        self.regions()
        publish_control(self.group, KIND_KV_READ, channel=self.channel)
        request = [(sources, pairs)]
        dist.broadcast_object_list(request, src=0, group=self.group)
        error, moved = None, 0
        try:
            moved = self.mine.read(sources, pairs)
        except Exception as e:  # noqa: BLE001 - reported with the workers' below
            error = f"rank 0: {e}"
        replies = _gather(self.group, (error, moved))
        errors = [e for e, _ in replies if e]
        if errors:
            raise RuntimeError("KV transfer into the tensor-parallel ranks failed: " + "; ".join(errors))
        return sum(n for _, n in replies)


def serve_worker_request(kind: int, group: Any, mine: RankTransfer) -> bool:
    """A worker: handle rank 0's transfer request ``kind``; False when ``kind`` is none of them."""
    if kind == KIND_KV_AGENT:
        _gather(group, mine.region_msg())
        return True
    if kind == KIND_KV_READ:
        request: list[Any] = [None]
        dist.broadcast_object_list(request, src=0, group=group)
        sources, pairs = request[0]
        error, moved = None, 0
        try:
            moved = mine.read(sources, pairs)
        except Exception as e:  # noqa: BLE001 - rank 0 raises it for the instance
            error = f"rank {dist.get_rank()}: {e}"
        _gather(group, (error, moved))
        return True
    return False


def single_region(region: KVRegion, num_heads: int) -> list[KVRankRegionMsg]:
    """An instance of one rank as the rank list of an export."""
    return [
        KVRankRegionMsg(
            session=region.session, layer_addrs=list(region.layer_addrs), num_blocks=region.num_blocks,
            block_bytes=region.block_bytes, first_head=0, num_heads=num_heads,
        )
    ]  # fmt: skip


def _rank_kv(msg: KVRankRegionMsg) -> RankKV:
    region = KVRegion(msg.session, list(msg.layer_addrs), msg.num_blocks, msg.block_bytes)
    return RankKV(region, msg.first_head, msg.num_heads)


def _gather(group: Any, mine: object) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out
