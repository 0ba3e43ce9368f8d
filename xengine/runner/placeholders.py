"""Async scheduling's placeholder tokens resolved on the device side of a step.

A step scheduled before its predecessor finished names the tokens that predecessor samples as
placeholders ``-(1 + row)`` (``xengine/scheduler/in_flight.py``); the runner replaces them with row
``row`` of the previous step's sampled tokens, in the step's inputs and in the histories penalties read.
"""

from __future__ import annotations

import torch


def resolve(token_ids: torch.Tensor, prev_rows: torch.Tensor) -> torch.Tensor:
    """``token_ids`` with every placeholder replaced by its row of ``prev_rows``."""
    rows = (-token_ids - 1).clamp_(min=0, max=prev_rows.shape[0] - 1)
    return torch.where(token_ids < 0, prev_rows.to(token_ids.dtype)[rows], token_ids)


def resolve_lists(histories: list[list[int]], prev_rows: torch.Tensor) -> list[list[int]]:
    """The same for host token histories (penalties need the real previous tokens)."""
    prev = prev_rows.tolist()
    return [[t if t >= 0 else prev[-t - 1] for t in ids] for ids in histories]
