"""Publish which images an instance's image-embedding cache holds, under its lease (VL models).

The service (EPD placement) routes a request to an instance holding its images, which then encodes
nothing. ``ImageHashTracker`` learns the set without walking the cache (every image the instance was
sent or imported is a candidate; a report keeps those still cached); ``ImagePublishingAgent`` is the
``ClusterAgent`` that writes it (``keys.ImageSet``) on each heartbeat where it changed. See
``docs/multimodal.md`` (image-cache index).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from xengine.process.cluster_agent import ClusterAgent

MAX_CANDIDATES = 4096


class ImageHashTracker:
    def __init__(self, cache: Any, max_candidates: int = MAX_CANDIDATES) -> None:
        self.cache = cache  # ImageEmbeddingCache (``contains`` is thread-safe)
        self.max_candidates = max_candidates
        self._candidates: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def saw(self, content_hashes: Iterable[str]) -> None:
        """Images this instance was sent or imported (engine thread)."""
        with self._lock:
            for h in content_hashes:
                self._candidates[h] = None
                self._candidates.move_to_end(h)
            while len(self._candidates) > self.max_candidates:
                self._candidates.popitem(last=False)

    def held(self) -> list[str]:
        """The candidates the cache holds now, sorted (any thread)."""
        with self._lock:
            candidates = list(self._candidates)
        return sorted(h for h in candidates if self.cache.contains(h))


class ImagePublishingAgent(ClusterAgent):
    def __init__(self, *args: Any, tracker: ImageHashTracker, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = tracker
        self._published: tuple[int, list[str]] | None = None  # (registration, hashes) last written
        self._image_seq = 0

    async def _beat(self, store: Any) -> None:
        await super()._beat(store)
        await self._publish_images(store)

    async def _publish_images(self, store: Any) -> None:
        from xengine.api.cluster import keys

        hashes = self.tracker.held()
        if self._published == (self.num_registrations, hashes):
            return
        self._image_seq += 1
        record = keys.ImageSet(incarnation=self.record.incarnation, seq=self._image_seq, hashes=hashes)
        k = keys.key(self.key_prefix, "images", self.record.name)
        await store.put(k, keys.encode(record), self._lease)
        self._published = (self.num_registrations, hashes)
