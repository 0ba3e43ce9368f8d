"""The multimodal part of one step's inputs (built on the engine thread with the rest of them).

Sequences of requests with images get M-RoPE positions: ``[3, T]`` for the whole step when any of
its tokens is an image pad, else one id per token (the text path: a text token's three ids are equal)
shifted by each request's ``delta``. The image pieces say which rows of which image's embeddings
replace which tokens' embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from xengine.multimodal.image_cache import ImagePiece
from xengine.scheduler.plan import SchedulePlan


@dataclass
class MultiModalStep:
    positions: torch.Tensor  # [3, T] with image pieces, else [T]
    pieces: list[ImagePiece] = field(default_factory=list)
    done_seq_ids: list[str] = field(default_factory=list)  # prefill past their last image after this step


def has_images(plan: SchedulePlan) -> bool:
    return any(s.req.mm is not None for s in plan.seqs)


def build_multimodal_step(plan: SchedulePlan, device: torch.device) -> MultiModalStep:
    """Positions and image pieces of ``plan`` (which holds at least one request with images)."""
    rows: list[np.ndarray] = []
    pieces: list[ImagePiece] = []
    done: list[str] = []
    dest = 0
    for s in plan.seqs:
        req, start, end = s.req, s.start, s.end
        mm = req.mm
        if mm is None:
            rows.append(np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, end - start)))
        else:
            rows.append(mm.positions_of(start, end))
            for im in mm.images:
                lo, hi = max(start, im.offset), min(end, im.offset + im.length)
                if lo < hi:
                    pieces.append(
                        ImagePiece(req.seq_id, im, lo - im.offset, hi - im.offset, dest + lo - start)
                    )
            if start < mm.images_end <= end:
                done.append(req.seq_id)
        dest += end - start
    positions = np.concatenate(rows, axis=1)
    chosen = positions if pieces else positions[0]
    return MultiModalStep(torch.from_numpy(np.ascontiguousarray(chosen)).to(device), pieces, done)
