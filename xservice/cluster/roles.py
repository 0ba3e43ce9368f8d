"""``RoleTable``: dynamic PD roles kept in the metadata store, so a restarted service sees them.

Each instance has a ``RoleRecord`` under ``<prefix>/roles/<name>``: its launch role (``origin``:
prefill or decode), the role it serves now, and its recent flips with their reasons. A flip
changes the in-memory table at once (the next routing decision sees it: zero wait, no restart,
in-flight work finishes where it is) and writes the record in the background; a store outage only
delays the write (retried on the next flip or by ``flush``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from xengine.api.cluster import keys
from xengine.api.cluster.store import BaseMetadataStore

logger = logging.getLogger(__name__)

HISTORY = 20  # flips kept per instance record


class RoleTable:
    def __init__(self, store: BaseMetadataStore, key_prefix: str = "/xllm") -> None:
        self.store = store
        self.prefix = key_prefix.rstrip("/")
        self.records: dict[str, keys.RoleRecord] = {}
        self.flipped_at: dict[str, float] = {}  # name -> time.monotonic() of its last flip here
        self._dirty: set[str] = set()
        self._lock = asyncio.Lock()

    async def load(self, launch_roles: dict[str, str]) -> dict[str, keys.RoleRecord]:
        """Read every stored record; instances in ``launch_roles`` (name -> prefill | decode) without one
        start in their launch role. Returns the records restored from the store."""
        data, _ = await self.store.get_prefix(f"{self.prefix}/roles/")
        restored = {}
        for k, raw in data.items():
            parsed = keys.parse_key(self.prefix, k)
            rec = keys.decode(raw, keys.RoleRecord)
            if parsed is not None and rec is not None and rec.role in ("prefill", "decode"):
                self.records[parsed[1]] = restored[parsed[1]] = rec
        for name, role in launch_roles.items():
            self.ensure(name, role)
        return restored

    def ensure(self, name: str, origin: str) -> keys.RoleRecord:
        """The record of ``name``, created in its launch role when it has none."""
        rec = self.records.get(name)
        if rec is None:
            rec = self.records[name] = keys.RoleRecord(origin=origin, role=origin)
            self._dirty.add(name)
        return rec

    def role(self, name: str) -> str | None:
        rec = self.records.get(name)
        return rec.role if rec is not None else None

    def flip(self, name: str, to_role: str, reason: str) -> keys.RoleRecord:
        rec = self.records[name]
        entry = keys.FlipEntry(at=time.time(), to_role=to_role, reason=reason)
        rec.role, rec.num_flips = to_role, rec.num_flips + 1
        rec.history = [*rec.history, entry][-HISTORY:]
        self.flipped_at[name] = time.monotonic()
        self._dirty.add(name)
        return rec

    async def flush(self) -> None:
        """Write the changed records (kept dirty when the store is unreachable)."""
        async with self._lock:
            for name in sorted(self._dirty):
                try:
                    await self.store.put(f"{self.prefix}/roles/{name}", keys.encode(self.records[name]))
                except Exception as e:  # noqa: BLE001 - the store may be down; retried on the next flush
                    logger.warning("could not persist the role of %s (%s); will retry", name, e)
                    return
                self._dirty.discard(name)

    def history(self) -> list[dict]:
        """Every instance's recorded flips, oldest first."""
        out = [
            {"instance": name, "at": e.at, "to_role": e.to_role, "reason": e.reason}
            for name, rec in self.records.items()
            for e in rec.history
        ]
        return sorted(out, key=lambda e: (e["at"], e["instance"]))
