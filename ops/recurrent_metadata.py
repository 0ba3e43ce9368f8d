"""What one step's recurrent layers (Mamba2 / gated DeltaNet) need to know about its batch.

A recurrent layer carries a fixed-size state per sequence instead of KV per token: each running
sequence owns one slot of every recurrent layer's state tensors (``memory/recurrent_state.py``), and
a step continues from the state its slot holds. Prefix caching keeps *snapshots* of those states at
block-aligned positions in slots of their own; a step that crosses such a position writes the state
there (``checkpoints``). Plain data, built once per step by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecurrentMetadata:
    query_start_loc: list[int]  # [B + 1]: sequence i's tokens are rows query_start_loc[i] .. [i + 1] - 1
    slots: list[int]  # [B]: each sequence's state slot
    has_state: list[bool]  # [B]: True: continue from the slot's state; False: start from zeros
    # per sequence: (tokens of this step's chunk after which to snapshot, snapshot slot), ascending
    checkpoints: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def is_all_decode(self) -> bool:
        """One token per sequence and no snapshot to take: the layers run the batch as one."""
        q = self.query_start_loc
        return all(q[i + 1] - q[i] == 1 for i in range(len(self.slots))) and not any(self.checkpoints)
