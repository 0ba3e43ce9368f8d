"""PD disaggregation, engine side: export prompt KV from a prefill instance, import it on a decode one.

The prefix cache is the landing zone, so the scheduler does not change: ``export`` pins a prompt's
cached whole blocks and describes them; ``import_`` pulls the blocks its own prefix cache misses with
one batched Mooncake read, inserts them under the prompt's tokens and pins them until the decode
request is admitted; pins also expire (a service that died). The Mooncake agent starts on first use,
so a single node never needs it. See ``docs/cluster.md`` (PD disaggregation). Blocks move as bytes, an
8-bit cache's scales with them; both instances must hold the same element type (``cache.kv_cache_dtype``),
which ``import_`` checks before reading anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from memory.kv_cache_manager import ComputedPrefix, KVCacheManager
from memory.kv_layout import KVCacheSpec
from memory.transfer import KVRegion, KVTransferAgent, TransferStats
from xengine.api.messages import KVExportInfo, KVImportResult
from xengine.disagg.head_transfer import HeadTransfer
from xengine.disagg.hybrid_transfer import HybridPin, HybridReadStats, StateTransfer, WindowTransfer
from xengine.disagg.tp_transfer import GroupTransfer, RankTransfer, single_region

DEFAULT_PIN_TIMEOUT_S = 60.0


@dataclass
class _Pin:
    block_ids: list[int]
    deadline: float
    until_admitted: bool  # import pins end when the request of the same id is admitted
    hybrid: HybridPin | None = None  # window blocks and a state snapshot (hybrid models)
    head_blocks: list[int] | None = None  # a draft head's blocks of the prompt (speculative decoding)


class KVTransferManager:
    def __init__(
        self,
        kv: KVCacheManager,
        kv_caches: list[torch.Tensor],
        spec: KVCacheSpec,
        host: str = "127.0.0.1",
        pin_timeout_s: float = DEFAULT_PIN_TIMEOUT_S,
        port_range: tuple[int, int] | None = None,
        window: WindowTransfer | None = None,
        states: StateTransfer | None = None,
        head: HeadTransfer | None = None,
        ranks: GroupTransfer | None = None,
    ) -> None:
        """``kv_caches``: the full-attention layers' tensors; ``window`` / ``states``: a hybrid model's
        sliding-window pool and recurrent state pool, sent beside them (``hybrid_transfer.py``); ``head``:
        a draft head's pool (``head_transfer.py``); ``ranks``: a tensor-parallel instance's ranks, each
        moving its own KV heads (``tp_transfer.py``)."""
        self.kv = kv
        self.ranks = ranks
        self.window = window
        self.states = states
        self.head = head
        self.kv_caches = kv_caches
        self.spec = spec
        self.host = host
        self.port_range = port_range  # of the agent's two listeners (cache.kv_transfer_port_range)
        self.pin_timeout_s = pin_timeout_s
        self._agent: KVTransferAgent | None = None
        self._pins: dict[str, _Pin] = {}
        self.num_blocks_imported = 0
        self.num_bytes_imported = 0

    def start(self) -> KVTransferAgent:
        """Create the transfer agent (registers the KV memory) if it does not exist yet."""
        if self._agent is None:
            if self.ranks is not None:  # rank 0's agent is its share of the group's
                agent = self.ranks.mine.start()
            else:
                agent = KVTransferAgent(self.kv_caches, self.host, self.port_range)
            for part in (self.window, self.states, self.head):
                if part is not None:
                    part.register(agent)
            self._agent = agent
        return self._agent

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    @property
    def num_peers_refused(self) -> int:
        """Connections to the transfer agent's listeners closed because another local user made them
        (``memory/transfer.py``); 0 before the agent exists."""
        return self._agent.num_peers_refused if self._agent is not None else 0

    # ------------------------------------------------------------------ prefill side

    def export(self, export_id: str, token_ids: list[int], next_token_id: int | None = None) -> KVExportInfo:
        """Pin the cached whole blocks of ``token_ids`` and describe them for a peer (with a draft head's
        blocks of them; ``next_token_id``: the token the prefill sampled, which keys the last one)."""
        agent = self.start()
        self.expire()
        if export_id in self._pins:
            raise ValueError(f"invalid value for 'export_id': {export_id!r} is already pinned")
        cache = self.kv.prefix_cache
        block_ids = cache.match(token_ids).block_ids if cache is not None else []
        if self.window is not None or self.states is not None:  # as far as every layer kind resumes
            bs = self.spec.block_size
            block_ids = self.kv.usable_prefix(ComputedPrefix(block_ids, len(block_ids) * bs)).block_ids
        hybrid, window, state = HybridPin(), None, None
        if block_ids and self.window is not None:
            window, hybrid.window_blocks = self.window.export(agent.region.session, block_ids)
        if block_ids and self.states is not None:
            state = self.states.export(block_ids[-1])
            hybrid.state_slot = state.slot
        head, head_blocks = None, None
        if self.head is not None:
            head, head_blocks = self.head.export(
                agent.region.session, token_ids, next_token_id, len(block_ids)
            )
        self._pin(export_id, block_ids, until_admitted=False, hybrid=hybrid, head_blocks=head_blocks)
        s, region = self.spec, agent.region
        return KVExportInfo(
            window=window,
            state=state,
            head=head,
            session=region.session,
            layer_addrs=list(region.layer_addrs),
            num_blocks=region.num_blocks,
            block_bytes=region.block_bytes,
            block_size=s.block_size,
            num_layers=s.num_layers,
            num_kv_heads=self.total_heads,
            head_dim=s.head_dim,
            dtype=s.cache_dtype_name,
            block_ids=block_ids,
            ranks=self.ranks.regions() if self.ranks is not None else None,
        )

    @property
    def total_heads(self) -> int:
        """The model's KV heads (a tensor-parallel rank holds some of them)."""
        return self.ranks.total_heads if self.ranks is not None else self.spec.num_kv_heads

    # ------------------------------------------------------------------ decode side

    def import_(
        self, source: KVExportInfo, token_ids: list[int], pin_id: str, next_token_id: int | None = None
    ) -> KVImportResult:
        """Make the prompt's leading whole blocks local (transferring only misses) and pin them (a draft
        head's blocks too, when the exporter sent its head's and this instance runs the same head)."""
        t0 = time.perf_counter()
        agent = self.start()
        self.expire()
        self._check_compatible(source)
        cache = self.kv.prefix_cache
        if cache is None:
            raise ValueError("KV import needs the prefix cache (cache.enable_prefix_caching)")
        if pin_id in self._pins:
            raise ValueError(f"invalid value for 'pin_id': {pin_id!r} is already pinned")
        bs = self.spec.block_size
        num_full = min(len(source.block_ids), len(token_ids) // bs)
        hits = cache.match(token_ids, num_full).block_ids
        cache.lock(hits)
        num_missing = min(num_full - len(hits), self.kv.pool.num_free_blocks)  # rest: recomputed
        new = self.kv.pool.allocate(num_missing)
        pairs = list(zip(source.block_ids[len(hits) :], new))
        try:
            if source.ranks is not None or self.ranks is not None:  # the heads are split on a side
                stats = self._read_heads(agent, source, pairs)
            else:
                stats = agent.read_blocks(self._region(source), pairs)
        except BaseException:
            self.kv.pool.free(list(reversed(new)) + list(reversed(hits)))
            raise
        block_ids = hits + new
        cache.insert(token_ids[: len(block_ids) * bs], block_ids, len(hits))
        hybrid, extra = HybridPin(), HybridReadStats()
        if len(block_ids) == len(source.block_ids) and block_ids:  # else the hit is shortened anyway
            try:
                hybrid, extra = self._import_hybrid(agent, source, block_ids)
            except BaseException:
                self.kv.pool.free(list(reversed(block_ids)))
                raise
        head_blocks, num_head, head_bytes = None, 0, 0
        if source.head is not None and self.head is not None and len(block_ids) == len(source.head.block_ids):
            try:
                head_blocks, num_head, head_bytes = self.head.import_(
                    agent, source.session, source.head, token_ids, next_token_id
                )
            except BaseException:
                self.kv.pool.free(list(reversed(block_ids)))
                self._release_hybrid(hybrid)
                raise
        pin = dict(hybrid=hybrid, head_blocks=head_blocks)
        self._pin(pin_id, block_ids, until_admitted=True, locked=True, **pin)
        num_bytes = stats.num_bytes + extra.num_window_bytes + extra.num_state_bytes + head_bytes
        self.num_blocks_imported += stats.num_blocks
        self.num_bytes_imported += num_bytes
        return KVImportResult(
            num_blocks=len(block_ids),
            num_hit_blocks=len(hits),
            num_transferred_blocks=stats.num_blocks,
            num_bytes=num_bytes,
            transfer_s=time.perf_counter() - t0,
            num_window_blocks=extra.num_window_blocks,
            num_window_bytes=extra.num_window_bytes,
            num_state_bytes=extra.num_state_bytes,
            num_head_blocks=num_head,
            num_head_bytes=head_bytes,
        )

    def _import_hybrid(
        self, agent: KVTransferAgent, source: KVExportInfo, block_ids: list[int]
    ) -> tuple[HybridPin, HybridReadStats]:
        """The window blocks and the state snapshot of a hybrid model's import (pinned with it)."""
        pin, total = HybridPin(), HybridReadStats()
        if source.window is not None and self.window is not None:
            pin.window_blocks, part = self.window.import_(agent, source.session, source.window, block_ids)
            total.num_window_blocks, total.num_window_bytes = part.num_window_blocks, part.num_window_bytes
        if source.state is not None and self.states is not None:
            try:
                pin.state_slot, part = self.states.import_(agent, source.session, source.state, block_ids[-1])
            except BaseException:
                if self.window is not None:
                    self.window.release(pin.window_blocks)
                raise
            total.num_state_bytes = part.num_state_bytes
        return pin, total

    def _read_heads(
        self, agent: KVTransferAgent, source: KVExportInfo, pairs: list[tuple[int, int]]
    ) -> TransferStats:
        """Blocks whose heads are split differently on the two sides: each of this instance's ranks
        reads its heads from the source ranks holding them."""
        t0 = time.perf_counter()
        if not pairs:
            return TransferStats(0, 0, 0, 0.0)
        sources = source.ranks or single_region(self._region(source), source.num_kv_heads)
        if self.ranks is not None:
            moved = self.ranks.read(sources, pairs)
        else:
            s = self.spec
            moved = RankTransfer(self.kv_caches, 0, s.num_kv_heads, s.block_size, agent=agent).read(
                sources, pairs
            )
        return TransferStats(len(pairs), moved, 0, time.perf_counter() - t0)

    def _check_compatible(self, source: KVExportInfo) -> None:
        s = self.spec
        mine = (s.block_size, s.num_layers, self.total_heads, s.head_dim, s.cache_dtype_name)
        theirs = (source.block_size, source.num_layers, source.num_kv_heads, source.head_dim, source.dtype)
        # a kind the exporter sent that this side cannot hold (an export of no blocks sends none)
        kinds = (source.window is not None and self.window is None) or (
            source.state is not None and self.states is None
        )
        if mine != theirs or kinds:
            raise ValueError(
                "KV layouts of the prefill and decode instances differ "
                f"(block_size, layers, kv heads, head_dim, KV dtype): {theirs} vs {mine}; "
                "run both with the same model, dtype, cache.kv_cache_dtype and cache.block_size"
            )

    @staticmethod
    def _region(source: KVExportInfo) -> KVRegion:
        return KVRegion(source.session, list(source.layer_addrs), source.num_blocks, source.block_bytes)

    # ------------------------------------------------------------------ pins

    def _pin(
        self,
        pin_id: str,
        block_ids: list[int],
        until_admitted: bool,
        locked: bool = False,
        hybrid: HybridPin | None = None,
        head_blocks: list[int] | None = None,
    ) -> None:
        if not locked:
            self.kv.pool.touch(block_ids)
        deadline = time.monotonic() + self.pin_timeout_s
        self._pins[pin_id] = _Pin(block_ids, deadline, until_admitted, hybrid, head_blocks)

    def release(self, pin_id: str) -> bool:
        """Drop the pin ``pin_id``; False when there was none."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        self.kv.pool.free(list(reversed(pin.block_ids)))
        self._release_hybrid(pin.hybrid)
        if pin.head_blocks and self.head is not None:
            self.head.release(pin.head_blocks)
        return True

    def _release_hybrid(self, hybrid: HybridPin | None) -> None:
        if hybrid is not None:
            if self.window is not None:
                self.window.release(hybrid.window_blocks)
            if self.states is not None:
                self.states.release(hybrid.state_slot)

    def release_admitted(self, admitted: set[str] | dict[str, object]) -> None:
        """Drop import pins whose request now holds its own references (it was admitted)."""
        for pin_id in [p for p, pin in self._pins.items() if pin.until_admitted and p in admitted]:
            self.release(pin_id)

    def release_waiting_imports(self, keep: str) -> int:
        """Drop every import pin but ``keep``'s; their blocks stay in the prefix cache, evictable. For a
        decode instance whose pool is all pinned by imported prompts of queued requests, so that the
        first of them (``keep``) cannot get the block it still needs and nothing runs to free one.
        Returns the pins dropped."""
        drop = [p for p, pin in self._pins.items() if pin.until_admitted and p != keep]
        for pin_id in drop:
            self.release(pin_id)
        return len(drop)

    def release_all(self) -> int:
        """Drop every pin (the instance was fenced off: no service will pull or admit them); the count."""
        pin_ids = list(self._pins)
        for pin_id in pin_ids:
            self.release(pin_id)
        return len(pin_ids)

    def expire(self) -> None:
        now = time.monotonic()
        for pin_id in [p for p, pin in self._pins.items() if pin.deadline < now]:
            self.release(pin_id)
