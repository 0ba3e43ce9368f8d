"""``BaseMetadataStore``: the key-value + lease + watch interface the cluster needs.

Keys and values are ``str`` / ``bytes``. Every method may raise ``StoreUnavailableError`` when the
store cannot be reached; callers keep their last view and retry. Semantics follow etcd v3:
a key put under a lease disappears (with a delete event) when the lease is revoked or not kept
alive within its TTL; ``watch_prefix`` yields every change after ``start_revision``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal


class StoreUnavailableError(ConnectionError):
    """The metadata store did not answer (down, unreachable, or the watch stream broke)."""


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes  # empty for deletes
    revision: int


class BaseMetadataStore(abc.ABC):
    @abc.abstractmethod
    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Set ``key``; returns the store revision of the write."""

    @abc.abstractmethod
    async def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        """Set ``key`` only if it does not exist (one transaction); True when written."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """True when the key existed."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` and the store revision the snapshot was read at."""

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: float) -> int:
        """A new lease id that expires ``ttl_s`` after its last keepalive."""

    @abc.abstractmethod
    async def keepalive(self, lease: int) -> bool:
        """Refresh ``lease``; False when it already expired (its keys are gone)."""

    @abc.abstractmethod
    async def revoke(self, lease: int) -> None:
        """Drop ``lease`` and delete its keys now."""

    @abc.abstractmethod
    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        """Events under ``prefix`` from ``start_revision`` (inclusive) on; ends by raising
        ``StoreUnavailableError`` when the stream breaks."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
