"""EPD placement: which instance encodes a request's images, and which prefills it (pure, no I/O).

Both choices score candidates like ``cache_aware`` routing, with images instead of KV blocks:
``score = match_weight x images held / images of the request - load / max load``, highest first,
ties to the lower load, then the name. An instance that holds every image of the request then skips
their encoding (the prefill instance itself: no encode stage at all; an encode instance: no encode,
only the embedding transfer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xservice.policies.routing import InstanceSnapshot


@dataclass(frozen=True)
class ImagePlacement:
    name: str
    holds_all: bool  # the instance's image cache holds every image of the request (by the index)


def select_by_images(
    candidates: Sequence[InstanceSnapshot],
    held: Mapping[str, int],
    num_images: int,
    match_weight: float = 2.0,
) -> ImagePlacement | None:
    """The best of ``candidates`` for a request of ``num_images`` distinct images, of which instance
    ``n`` holds ``held[n]``; None without candidates."""
    if not candidates:
        return None
    max_load = max(1, max(c.load for c in candidates))

    def key(c: InstanceSnapshot) -> tuple[float, int, str]:
        frac = held.get(c.name, 0) / num_images if num_images else 0.0
        return (-(match_weight * frac - c.load / max_load), c.load, c.name)

    best = min(candidates, key=key)
    return ImagePlacement(best.name, num_images > 0 and held.get(best.name, 0) >= num_images)
