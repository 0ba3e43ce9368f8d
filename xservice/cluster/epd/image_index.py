"""Global image index (EPD): which instance's image-embedding cache holds which image, by content hash.

Engines of vision-language models publish their cache's hashes under ``<prefix>/images/<name>``
(``keys.ImageSet``, the whole set, leased with the instance; ``xengine/process/image_publisher.py``). This
index watches that prefix and keeps each instance's latest set, used only while it comes from the
instance's registered incarnation. The service also notes what it just placed (an encode, an
import) at once, so the next request does not wait a heartbeat to see it; the instance's published
set takes over a few seconds later (an image it evicted then drops out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from xengine.api.cluster import keys
from xengine.api.cluster.store import BaseMetadataStore, StoreUnavailableError, WatchEvent

logger = logging.getLogger(__name__)

NOTED_FOR_S = 5.0  # how long the service's own notes outlive a published set that lacks them
MAX_BACKOFF_S = 2.0


class ImageIndex:
    def __init__(
        self,
        store: BaseMetadataStore,
        key_prefix: str,
        incarnation_of: Callable[[str], str | None],  # instance name -> registered incarnation
    ) -> None:
        self.store = store
        self.prefix = key_prefix.rstrip("/")
        self._incarnation_of = incarnation_of
        self._published: dict[str, tuple[str, set[str]]] = {}  # name -> (incarnation, hashes)
        self._noted: dict[str, dict[str, float]] = {}  # name -> hash -> time.monotonic() noted
        self._task: asyncio.Task | None = None
        self.num_updates = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ------------------------------------------------------------------ queries

    def held(self, content_hashes: Sequence[str]) -> dict[str, int]:
        """Per instance, how many of ``content_hashes`` (distinct) its image cache holds."""
        wanted = set(content_hashes)
        out: dict[str, int] = {}
        for name in set(self._published) | set(self._noted):
            n = len(wanted & self.hashes_of(name))
            if n:
                out[name] = n
        return out

    def hashes_of(self, name: str) -> set[str]:
        published = self._published.get(name)
        hashes = set()
        if published is not None and published[0] == self._incarnation_of(name):
            hashes |= published[1]
        now = time.monotonic()
        hashes |= {h for h, at in self._noted.get(name, {}).items() if now - at < NOTED_FOR_S}
        return hashes

    # ------------------------------------------------------------------ updates

    def note(self, name: str, content_hashes: Iterable[str]) -> None:
        """The service just put these images into ``name``'s cache (an encode or an import)."""
        now = time.monotonic()
        self._noted.setdefault(name, {}).update(dict.fromkeys(content_hashes, now))

    def drop(self, name: str) -> None:
        """The instance is gone."""
        self._published.pop(name, None)
        self._noted.pop(name, None)

    def apply(self, event: WatchEvent) -> None:
        parsed = keys.parse_key(self.prefix, event.key)
        if parsed is None or parsed[0] != "images":
            return
        name = parsed[1]
        if event.kind == "delete":
            self.drop(name)
            return
        record = keys.decode(event.value, keys.ImageSet)
        if record is None:
            return
        self._published[name] = (record.incarnation, set(record.hashes))
        now = time.monotonic()
        noted = self._noted.get(name, {})
        for h in [h for h, at in noted.items() if now - at >= NOTED_FOR_S or h in record.hashes]:
            del noted[h]
        self.num_updates += 1

    async def _watch_loop(self) -> None:
        backoff = 0.1
        prefix = f"{self.prefix}/images/"
        while True:
            try:
                data, revision = await self.store.get_prefix(prefix)
                for k, v in data.items():
                    self.apply(WatchEvent("put", k, v, revision))
                for name in set(self._published) - {keys.parse_key(self.prefix, k)[1] for k in data}:
                    self._published.pop(name, None)
                backoff = 0.1
                async for event in self.store.watch_prefix(prefix, revision + 1):
                    self.apply(event)
            except StoreUnavailableError as e:
                logger.debug("image index: store unavailable (%s); retrying", e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
