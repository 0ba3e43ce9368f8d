"""Recurrent-state slots: one per running sequence, plus snapshots of states for prefix hits.

A recurrent layer (Mamba2, gated DeltaNet) keeps a fixed-size state per sequence instead of KV per
token, and the state cannot be rolled back: it is the whole past folded in. So the pool has two
kinds of slots (ids here; the tensors are ``memory/recurrent_state_pool.py``, one tuple per recurrent layer):

- a *sequence slot* for each running sequence: its state after the tokens it computed. A fork (n > 1,
  beam search) gets a slot of its own and a copy, never a share;
- *snapshot slots*: the state at a block-aligned position, taken every ``interval`` tokens while a
  sequence runs (``checkpoints``). Once the step that wrote one is applied and the block ending at
  that position is in the prefix cache, the snapshot is keyed by that block (``by_block``). A prefix
  hit is usable only as far as the last block with a snapshot (``usable_blocks``), and taking it
  *copies* the snapshot into the new sequence's slot. Snapshots are evicted least recently used, and
  with their block when the prefix cache drops it.

Ids and bookkeeping only (like the block pool): copies are queued for the runner (``take_copies``).
See ``docs/hybrid_memory.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class RecurrentStateSlots:
    def __init__(
        self,
        num_seq_slots: int,
        num_snapshot_slots: int,
        block_size: int,
        interval: int,
        snapshots: bool,
        num_draft_slots: int = 0,
    ) -> None:
        """Slots ``0 .. num_seq_slots - 1`` hold running sequences, the next ones snapshots (taken only
        when ``snapshots``: prefix caching is on), the last ``num_draft_slots`` speculative decoding's
        per-draft states. ``interval``: tokens between snapshots, a multiple of ``block_size``."""
        if interval % block_size:
            raise ValueError(
                f"cache.state_snapshot_interval {interval} must be a multiple of the block size {block_size}"
            )
        self.num_seq_slots = num_seq_slots
        self.num_snapshot_slots = num_snapshot_slots if snapshots else 0
        self.block_size = block_size
        self.interval = interval
        self._free_seq = list(range(num_seq_slots - 1, -1, -1))
        self._free_snap = list(range(num_seq_slots + self.num_snapshot_slots - 1, num_seq_slots - 1, -1))
        first_draft = num_seq_slots + self.num_snapshot_slots
        self.num_draft_slots = num_draft_slots
        self._free_draft = list(range(first_draft + num_draft_slots - 1, first_draft - 1, -1))
        self._draft_step: dict[str, list[tuple[int, int]]] = {}  # this plan's per-draft checkpoints
        self._drafting: dict[str, list[int]] = {}  # per drafting sequence: its draft slots, in order
        self.slot_of: dict[str, int] = {}
        self.by_block: OrderedDict[int, int] = OrderedDict()  # cached block -> snapshot slot, LRU first
        self._block_of: dict[int, int] = {}  # snapshot slot -> its block
        self._pending: dict[str, list[tuple[int, int]]] = {}  # written, not yet keyed: (position, slot)
        self._step: dict[str, list[tuple[int, int]]] = {}  # this plan's checkpoints per sequence
        self._hits: set[int] = set()  # snapshot slots a hit of this plan reads: not evicted for it
        self._copies: list[tuple[int, int]] = []
        self._pins: dict[int, int] = {}  # snapshot slot -> pins (PD exports / imports): never evicted
        # told each block that gains / loses its snapshot (KV events: ``stateful_kv_cache_manager.py``)
        self.on_keyed: Callable[[int], None] | None = None
        self.on_dropped: Callable[[int], None] | None = None
        self._orphans: set[int] = set()  # pinned slots whose key went: freed at their last unpin
        # KV tiers (``xengine/tiered_hybrid.py``): told each block a sequence's own snapshot was keyed by
        self.recorded_hook: Callable[[int], None] | None = None
        self.num_snapshots_taken = 0
        self.num_snapshot_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_seq_slots(self) -> int:
        return len(self._free_seq)

    def usable_blocks(self, block_ids: list[int]) -> int:
        """How many of a prefix hit's blocks a sequence can resume after: up to the last one that has
        a snapshot (0: none)."""
        for k in range(len(block_ids), 0, -1):
            if block_ids[k - 1] in self.by_block:
                return k
        return 0

    def protect(self, block: int) -> None:
        """A prefix hit ending at ``block`` may be taken in this plan: keep its snapshot until then."""
        slot = self.by_block[block]
        self.by_block.move_to_end(block)
        self._hits.add(slot)

    # ------------------------------------------------------------------ sequences
    def allocate(self, seq_id: str, num_computed: int, num_total: int, hit_block: int | None) -> bool:
        """Give a new sequence its slot (and the hit's snapshot copied in), and plan this step's
        snapshots; False when no sequence slot is free (nothing changed then)."""
        if seq_id not in self.slot_of:
            if not self._free_seq:
                return False
            slot = self.slot_of[seq_id] = self._free_seq.pop()
            if hit_block is not None:
                snap = self.by_block[hit_block]
                self.by_block.move_to_end(hit_block)
                self._copies.append((snap, slot))
                self._hits.add(snap)
                self.num_snapshot_hits += 1
        if self.num_snapshot_slots:
            self._plan_checkpoints(seq_id, num_computed, num_total)
        return True

    def _plan_checkpoints(self, seq_id: str, num_computed: int, num_total: int) -> None:
        # snapshots planned past ``num_computed`` by an earlier plan that was never applied (a step
        # stopped midway and scheduled again) may be half written: drop them, plan them afresh
        pending = self._pending.get(seq_id)
        if pending and pending[-1][0] > num_computed:
            self._free_snap.extend(slot for pos, slot in pending if pos > num_computed)
            kept = [(pos, slot) for pos, slot in pending if pos <= num_computed]
            if kept:
                self._pending[seq_id] = kept
            else:
                del self._pending[seq_id]
        first = (num_computed // self.interval + 1) * self.interval
        taken = []
        for pos in range(first, num_total + 1, self.interval):
            slot = self._snapshot_slot()
            if slot is None:
                break
            taken.append((pos, slot))
        for _, slot in self._step.pop(seq_id, []):  # planned again (a retried allocation): replace
            self._free_snap.append(slot)
        if taken:
            self._step[seq_id] = taken

    def _snapshot_slot(self) -> int | None:
        if self._free_snap:
            return self._free_snap.pop()
        for block, slot in self.by_block.items():  # least recently used first
            if slot not in self._hits and slot not in self._pins:
                del self.by_block[block]
                del self._block_of[slot]
                if self.on_dropped is not None:
                    self.on_dropped(block)
                return slot
        return None

    def fork(self, parent_id: str, child_id: str) -> bool:
        """The child gets a slot holding a copy of the parent's state; False: no slot free."""
        if not self._free_seq:
            return False
        slot = self.slot_of[child_id] = self._free_seq.pop()
        self._copies.append((self.slot_of[parent_id], slot))
        return True

    def free(self, seq_id: str) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free_seq.append(slot)
        self._draft_step.pop(seq_id, None)
        self._free_draft.extend(self._drafting.pop(seq_id, []))
        for _, snap in self._pending.pop(seq_id, []) + self._step.pop(seq_id, []):
            self._free_snap.append(snap)

    # ------------------------------------------------------------------ speculative decoding
    def plan_drafts(self, seq_id: str, num_computed: int, num_drafts: int) -> bool:
        """A step computes the sequence's last token and ``num_drafts`` drafts after it: the state
        after the last token and after each draft but the last goes to a draft slot of its own
        (the state after the last draft is the sequence slot's, as always). False: too few slots."""
        self._free_draft.extend(self._drafting.pop(seq_id, []))  # planned again (a retried step)
        if num_drafts > len(self._free_draft):
            return False
        slots = [self._free_draft.pop() for _ in range(num_drafts)]
        self._drafting[seq_id] = slots
        self._draft_step[seq_id] = [(num_computed + 1 + j, slot) for j, slot in enumerate(slots)]
        return True

    def accept_drafts(self, seq_id: str, num_accepted: int) -> None:
        """The step ran and the first ``num_accepted`` drafts were accepted: unless all were, the
        sequence's state is the one after its last accepted token, copied from its draft slot before
        the next step runs. The draft slots are free again."""
        slots = self._drafting.pop(seq_id, [])
        if num_accepted < len(slots) and seq_id in self.slot_of:
            self._copies.append((slots[num_accepted], self.slot_of[seq_id]))
        self._free_draft.extend(slots)

    # ------------------------------------------------------------------ plans and snapshots
    def take_step(self) -> tuple[dict[str, list[tuple[int, int]]], list[tuple[int, int]]]:
        """This plan's checkpoints (per sequence: ``(position, slot)``: snapshots, and drafts' states
        under speculative decoding) and slot copies ``(src, dst)``, to run before its forward; the
        snapshots then wait for ``record``."""
        step, copies = self._step, self._copies
        for seq_id, points in step.items():
            self._pending.setdefault(seq_id, []).extend(points)
            self.num_snapshots_taken += len(points)
        if self._draft_step:
            step = {seq_id: list(points) for seq_id, points in step.items()}
            for seq_id, points in self._draft_step.items():
                step[seq_id] = sorted(step.get(seq_id, []) + points)
        self._step, self._copies, self._hits, self._draft_step = {}, [], set(), {}
        return step, copies

    def record(self, seq_id: str, num_computed: int, block_at: dict[int, int]) -> None:
        """The sequence's steps up to ``num_computed`` ran and its blocks are cached: key each snapshot
        written by then by the block ending at its position (``block_at``: position -> cached block)."""
        pending = self._pending.get(seq_id)
        if not pending:
            return
        left = []
        for pos, slot in pending:
            block = block_at.get(pos) if pos <= num_computed else None
            if pos > num_computed:
                left.append((pos, slot))
            elif block is None or block in self.by_block:  # not cached, or another snapshot has it
                self._free_snap.append(slot)
            else:
                self.key(block, slot)
                if self.recorded_hook is not None:
                    self.recorded_hook(block)
        if left:
            self._pending[seq_id] = left
        else:
            del self._pending[seq_id]

    def pending_positions(self, seq_id: str, num_computed: int) -> list[int]:
        """Positions of the sequence's written snapshots ready to key (at most ``num_computed``)."""
        return [pos for pos, _ in self._pending.get(seq_id, ()) if pos <= num_computed]

    def forget(self, blocks: list[int]) -> None:
        """The prefix cache dropped these blocks: their snapshots go with them."""
        for block in blocks:
            slot = self.by_block.pop(block, None)
            if slot is not None:
                del self._block_of[slot]
                if self.on_dropped is not None:
                    self.on_dropped(block)
                if slot in self._pins:
                    self._orphans.add(slot)
                else:
                    self._free_snap.append(slot)

    # ------------------------------------------------------------------ PD transfer
    def pin(self, slot: int) -> None:
        """Keep a snapshot (a PD export being read, an import waiting for its request) from eviction."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins.get(slot, 0) - 1
        if left > 0:
            self._pins[slot] = left
            return
        self._pins.pop(slot, None)
        if slot in self._orphans:
            self._orphans.discard(slot)
            self._free_snap.append(slot)

    def take_snapshot_slot(self) -> int | None:
        """A snapshot slot for an imported state (a free one, else the least recently used)."""
        return self._snapshot_slot()

    def give_back(self, slot: int) -> None:
        """Return a slot from ``take_snapshot_slot`` that was not keyed."""
        self._free_snap.append(slot)

    def key(self, block: int, slot: int) -> None:
        """Key a snapshot by the cached block ending at its position."""
        self.by_block[block] = slot
        self._block_of[slot] = block
        if self.on_keyed is not None:
            self.on_keyed(block)

    def reset(self) -> None:
        """Drop every keyed snapshot (the prefix cache was reset)."""
        self.forget(list(self.by_block))
