"""``EmbeddedStore``: an in-process metadata store with etcd's semantics (single node, no etcd).

Revisions grow by one per change; leases expire ``ttl`` after their last keepalive (checked by a
background task and on every call); watchers get every event after their start revision while
they are subscribed (a bounded history lets a watcher start slightly in the past).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import AsyncIterator

from xengine.api.cluster.store.base import BaseMetadataStore, WatchEvent

EXPIRY_CHECK_S = 0.1
HISTORY_LEN = 4096


class EmbeddedStore(BaseMetadataStore):
    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, int | None]] = {}  # key -> (value, lease)
        self._leases: dict[int, tuple[float, float]] = {}  # lease -> (ttl, deadline)
        self._lease_ids = itertools.count(1)
        self._revision = 1
        self._history: collections.deque[WatchEvent] = collections.deque(maxlen=HISTORY_LEN)
        self._watchers: list[tuple[str, asyncio.Queue[WatchEvent]]] = []
        self._expiry_task: asyncio.Task[None] | None = None

    def _ensure_expiry_task(self) -> None:
        if self._expiry_task is None or self._expiry_task.done():
            self._expiry_task = asyncio.get_running_loop().create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while True:
            self._expire()
            await asyncio.sleep(EXPIRY_CHECK_S)

    def _expire(self) -> None:
        now = time.monotonic()
        for lease, (_, deadline) in list(self._leases.items()):
            if deadline <= now:
                self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        self._leases.pop(lease, None)
        keys = [k for k, (_, owner) in self._data.items() if owner == lease]
        if keys:
            self._revision += 1
            for k in keys:
                del self._data[k]
                self._emit(WatchEvent("delete", k, b"", self._revision))

    def _emit(self, event: WatchEvent) -> None:
        self._history.append(event)
        for prefix, queue in self._watchers:
            if event.key.startswith(prefix):
                queue.put_nowait(event)

    def _check_lease(self, lease: int | None) -> None:
        if lease is not None and lease not in self._leases:
            raise ValueError(f"lease {lease} not found (expired or revoked)")

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        self._ensure_expiry_task()
        self._expire()
        self._check_lease(lease)
        self._revision += 1
        self._data[key] = (bytes(value), lease)
        self._emit(WatchEvent("put", key, bytes(value), self._revision))
        return self._revision

    async def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        self._expire()
        if key in self._data:
            return False
        await self.put(key, value, lease)
        return True

    async def get(self, key: str) -> bytes | None:
        self._expire()
        item = self._data.get(key)
        return None if item is None else item[0]

    async def delete(self, key: str) -> bool:
        self._expire()
        if key not in self._data:
            return False
        del self._data[key]
        self._revision += 1
        self._emit(WatchEvent("delete", key, b"", self._revision))
        return True

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        self._expire()
        return {k: v for k, (v, _) in sorted(self._data.items()) if k.startswith(prefix)}, self._revision

    async def grant_lease(self, ttl_s: float) -> int:
        self._ensure_expiry_task()
        lease = next(self._lease_ids)
        self._leases[lease] = (ttl_s, time.monotonic() + ttl_s)
        return lease

    async def keepalive(self, lease: int) -> bool:
        self._expire()
        if lease not in self._leases:
            return False
        ttl, _ = self._leases[lease]
        self._leases[lease] = (ttl, time.monotonic() + ttl)
        return True

    async def revoke(self, lease: int) -> None:
        self._drop_lease(lease)

    async def watch_prefix(self, prefix: str, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        self._ensure_expiry_task()
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        if start_revision is not None:
            for event in self._history:
                if event.revision >= start_revision and event.key.startswith(prefix):
                    queue.put_nowait(event)
        entry = (prefix, queue)
        self._watchers.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.remove(entry)

    async def close(self) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            self._expiry_task = None
