"""Draft slots of the recurrent-state pool (speculative decoding): a step's per-draft checkpoints come
with its plan beside the snapshots and are never keyed as snapshots; a partial accept queues one copy
into the sequence's slot, a full accept none; slots come back on accept, on free and on a re-plan."""

from __future__ import annotations

from memory.recurrent_state import RecurrentStateSlots


def _slots() -> RecurrentStateSlots:
    return RecurrentStateSlots(2, 4, block_size=4, interval=8, snapshots=True, num_draft_slots=6)


def test_draft_checkpoints_follow_the_last_token_and_sit_beside_snapshots() -> None:
    s = _slots()
    assert s.allocate("a", 5, 9, None)  # computes 5..8, with drafts: a snapshot at 8
    assert s.plan_drafts("a", 5, 3)
    step, copies = s.take_step()
    snaps = [(pos, slot) for pos, slot in step["a"] if slot < 6]
    drafts = [(pos, slot) for pos, slot in step["a"] if slot >= 6]
    assert [pos for pos, _ in drafts] == [6, 7, 8] and snaps == [(8, snaps[0][1])]
    assert step["a"] == sorted(step["a"]) and copies == []
    assert s.pending_positions("a", 100) == [8]  # only the snapshot waits to be keyed


def test_partial_accept_copies_the_last_accepted_state_and_full_accept_nothing() -> None:
    s = _slots()
    s.allocate("a", 5, 9, None)
    s.plan_drafts("a", 5, 3)
    slots = list(s._drafting["a"])
    s.take_step()
    s.accept_drafts("a", 1)
    _, copies = s.take_step()
    assert copies == [(slots[1], s.slot_of["a"])]
    assert len(s._free_draft) == 6
    s.plan_drafts("a", 7, 3)
    s.take_step()
    s.accept_drafts("a", 3)
    assert s.take_step()[1] == [] and len(s._free_draft) == 6


def test_slots_come_back_on_free_and_on_a_replan_and_run_out_cleanly() -> None:
    s = _slots()
    s.allocate("a", 5, 9, None)
    s.allocate("b", 5, 9, None)
    assert s.plan_drafts("a", 5, 4) and s.plan_drafts("a", 5, 4)  # planned again: the same count held
    assert len(s._free_draft) == 2
    assert not s.plan_drafts("b", 5, 3)  # too few left: nothing taken
    assert len(s._free_draft) == 2
    s.free("a")
    assert len(s._free_draft) == 6 and s.take_step()[0].get("a") is None
