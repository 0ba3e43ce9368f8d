"""The recurrent layers' view of a step (``ops/recurrent_metadata.py``), built from its plan."""

from __future__ import annotations

from ops.recurrent_metadata import RecurrentMetadata
from xengine.scheduler.plan import SchedulePlan


def recurrent_metadata(plan: SchedulePlan) -> RecurrentMetadata:
    """Each sequence's rows, state slot and whether it continues a state (it computed tokens before
    this step: its own, a prefix hit's snapshot or a fork's copy), and its snapshots as offsets into
    this step's chunk."""
    assert plan.state_slots is not None
    starts = [0]
    slots, has_state, checkpoints = [], [], []
    for s in plan.seqs:
        seq_id, start = s.req.seq_id, s.start
        starts.append(starts[-1] + s.num_new_tokens)
        slots.append(plan.state_slots[seq_id])
        has_state.append(start > 0)
        checkpoints.append([(pos - start, slot) for pos, slot in plan.state_checkpoints.get(seq_id, ())])
    return RecurrentMetadata(starts, slots, has_state, checkpoints)
