"""Recurrent-state slots and the stateful KV manager: slots per sequence, snapshots keyed by cached
blocks, hits shortened to the last snapshot, copies (never shares) on hits and forks."""

from __future__ import annotations

import pytest

from memory.recurrent_state import RecurrentStateSlots
from memory.stateful_kv_cache_manager import StatefulKVCacheManager

BS = 4


def manager(num_blocks: int = 64, seq_slots: int = 4, snapshots: int = 8, interval: int = 8):
    slots = RecurrentStateSlots(seq_slots, snapshots, BS, interval, snapshots=True)
    return StatefulKVCacheManager(num_blocks, BS, True, slots)


def run_prefill(kv: StatefulKVCacheManager, seq: str, tokens: list[int], chunk: int = 1000) -> list:
    """Schedule a prompt in chunks the way the scheduler does; returns each step's (checkpoints, copies)."""
    prefix = kv.get_computed_prefix(tokens)
    done, steps = prefix.num_tokens, []
    first = True
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert kv.allocate_slots(seq, done + n, prefix if first else None, done)
        first = False
        steps.append(kv.states.take_step())
        done += n
        kv.cache_blocks(seq, tokens, done)
    return steps


def test_interval_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="state_snapshot_interval"):
        RecurrentStateSlots(2, 2, 16, 24, snapshots=True)


def test_snapshots_at_every_interval_and_keyed_by_their_block() -> None:
    kv = manager()
    tokens = list(range(30))
    steps = run_prefill(kv, "a", tokens, chunk=12)
    points = [p for step, _ in steps for p in step.get("a", [])]
    assert [pos for pos, _ in points] == [8, 16, 24]  # positions 8, 16, 24 of a 30-token prompt
    table = kv.block_tables["a"]
    assert {kv.states.by_block[table[pos // BS - 1]] for pos, _ in points} == {slot for _, slot in points}


def test_hit_is_shortened_to_the_last_snapshot_and_copies_it() -> None:
    kv = manager()
    tokens = list(range(30))
    run_prefill(kv, "a", tokens)
    # a prompt sharing 27 tokens: the cache holds 6 whole blocks (24 tokens) of it; snapshots at 8/16/24
    other = tokens[:27] + [99, 98, 97]
    prefix = kv.get_computed_prefix(other)
    assert prefix.num_tokens == 24
    assert kv.allocate_slots("b", 30, prefix, 24)
    _, copies = kv.states.take_step()
    snap = kv.states.by_block[kv.block_tables["a"][5]]
    assert copies == [(snap, kv.states.slot_of["b"])]  # copied into b's own slot
    assert kv.states.slot_of["b"] != kv.states.slot_of["a"]


def test_hit_without_snapshot_is_refused() -> None:
    kv = manager(interval=16)
    tokens = list(range(14))
    run_prefill(kv, "a", tokens)  # 3 whole blocks cached, no 16-token position reached: no snapshot
    assert kv.prefix_cache is not None and kv.prefix_cache.match(tokens, 3).num_blocks == 3
    assert kv.get_computed_prefix(tokens + [1, 2, 3]).num_tokens == 0


def test_snapshot_dropped_with_its_block_shortens_the_hit() -> None:
    kv = manager(num_blocks=10)
    tokens = list(range(20))
    run_prefill(kv, "a", tokens)
    kv.free("a")
    assert kv.get_computed_prefix(tokens + [5]).num_tokens == 16
    run_prefill(kv, "b", [1000 + i for i in range(36)])  # needs 9 of the 10 blocks: evicts a's
    assert kv.get_computed_prefix(tokens + [5]).num_tokens < 16
    assert len(kv.states.by_block) <= kv.states.num_snapshot_slots


def test_snapshot_slots_evicted_least_recently_used() -> None:
    kv = manager(snapshots=2, interval=4)
    run_prefill(kv, "a", list(range(9)))  # snapshots at 4 and 8: both slots
    kv.free("a")
    run_prefill(kv, "b", [100 + i for i in range(5)])  # one more at 4: evicts a's oldest (at 4)
    assert kv.get_computed_prefix(list(range(9)) + [1]).num_tokens == 8  # the one at 8 stays
    assert kv.get_computed_prefix(list(range(5))).num_tokens == 0  # its 4-token snapshot went


def test_sequence_slots_bound_admission_and_forks_copy() -> None:
    kv = manager(seq_slots=2)
    assert kv.allocate_slots("a", 5, None, 0)
    assert kv.allocate_slots("b", 5, None, 0)
    assert not kv.allocate_slots("c", 5, None, 0)  # no state slot: the scheduler waits or preempts
    assert "c" not in kv.block_tables
    assert not kv.fork("a", "a#1", 5)
    kv.free("b")
    assert kv.fork("a", "a#1", 5)
    _, copies = kv.states.take_step()
    assert copies == [(kv.states.slot_of["a"], kv.states.slot_of["a#1"])]


def test_freeing_a_sequence_returns_its_unkeyed_snapshots() -> None:
    kv = manager(snapshots=3, interval=4)
    assert kv.allocate_slots("a", 12, None, 0)
    kv.states.take_step()  # three snapshots written by the step, never applied
    kv.free("a")
    assert kv.allocate_slots("b", 12, None, 0)
    step, _ = kv.states.take_step()
    assert len(step["b"]) == 3  # all three slots came back


def test_a_plan_never_applied_has_its_snapshots_planned_again() -> None:
    """A step stopped midway (offline work preempted between layers) wrote part of its snapshots; when
    the sequence is scheduled again from the same position, those slots are dropped, not keyed."""
    kv = manager(snapshots=4, interval=8)
    tokens = list(range(12))
    assert kv.allocate_slots("a", 12, None, 0)
    first, _ = kv.states.take_step()  # this step is stopped: never applied, nothing recorded
    assert kv.allocate_slots("a", 12, None, 0)  # scheduled again from position 0
    second, _ = kv.states.take_step()
    kv.cache_blocks("a", tokens, 12)
    keyed = kv.states.by_block[kv.block_tables["a"][1]]
    assert keyed == second["a"][0][1] and len(kv.states.by_block) == 1
    # no slot leaked: the other three are free (a new sequence plans three without evicting a's)
    assert kv.allocate_slots("b", 24, None, 0)
    assert len(kv.states.take_step()[0]["b"]) == 3 and len(kv.states.by_block) == 1


def test_kv_events_publish_only_blocks_a_snapshot_covers() -> None:
    """Cluster KV events are snapshot-safe: a block is published while a snapshot at or below it on
    its path exists, so the service's index never reports a hit the instance would shorten by more
    than the distance to its last snapshot."""
    kv = manager(snapshots=3, interval=8)
    events: list[tuple[list[int], list[int]]] = []
    kv.set_event_sink(lambda stored, removed: events.append((stored, removed)))
    tokens = list(range(30))  # 7 whole blocks of 4; snapshots at 8, 16, 24 (blocks 1, 3, 5)
    run_prefill(kv, "a", tokens)
    published = [h for stored, _ in events for h in stored]
    assert len(published) == 6  # blocks 0..5: block 6 (tokens 24..27) has no snapshot at its end
    assert kv.prefix_cache.hash_of(kv.block_tables["a"][6]) not in published
    kv.free("a")
    events.clear()
    run_prefill(kv, "b", [100 + i for i in range(9)])  # its snapshot at 8 evicts a's oldest (at 8)
    removed = [h for _, gone in events for h in gone]
    assert removed == []  # blocks 0 and 1 are still covered by the snapshots at 16 and 24
    events.clear()
    run_prefill(kv, "c", [200 + i for i in range(9)])  # evicts a's snapshot at 16 ...
    run_prefill(kv, "d", [300 + i for i in range(9)])  # ... then at 24: nothing covers a's blocks
    removed = [h for _, gone in events for h in gone]
    table = kv.block_tables.get("a") or kv.prefix_cache.match(tokens).block_ids
    assert {kv.prefix_cache.hash_of(b) for b in table[:6]} <= set(removed)
