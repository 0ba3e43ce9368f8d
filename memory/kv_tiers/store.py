"""L3 across the cluster: the Mooncake Store (``mooncake_master`` and the clients' segments).

Every instance is a client with no segment of its own (``global_segment_size`` 0): the memory the
store keeps records in belongs to a long-lived holder (``xservice/kv_store.py``), so a record outlives
the instance that put it (a killed instance's prompts are still there for the request migrated off
it). Records are keyed ``xllm/<layout fingerprint>/<chained hash>``: instances of one model and KV layout
share prefixes, other models never see them. Records move through one staging buffer registered
with the client (zero-copy for Mooncake), in batches.

An unreachable master makes every call slow (seconds of reconnecting) and fail: the first failure
marks the tier out for ``retry_s`` (lookups miss, writes are dropped, one warning), and a cheap
existence check brings it back once the master answers. Requests never fail for it.
"""

from __future__ import annotations

import logging
import time

import torch

from memory import bind_host
from memory.kv_tiers.base import KVTier

logger = logging.getLogger(__name__)

DEFAULT_RETRY_S = 2.0
_NOT_FOUND = -704  # OBJECT_NOT_FOUND: a miss, not an outage
_EXISTS = -708  # OBJECT_ALREADY_EXISTS: another instance stored it first


class StoreTier(KVTier):
    name = "store"

    def __init__(
        self,
        master: str,
        host: str,
        record_bytes: int,
        fingerprint: int,
        batch_blocks: int = 32,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        super().__init__(record_bytes)
        self.master = master
        self.host = host
        self.prefix = f"xllm/{fingerprint & (2**64 - 1):016x}/"
        self.batch_blocks = batch_blocks
        self.retry_s = retry_s
        self.staging = torch.empty((batch_blocks, record_bytes), dtype=torch.uint8)
        self._client = None
        self._down_until = 0.0
        self._warned = False
        self.stats.available = False

    # ------------------------------------------------------------------ connection
    def _connected(self) -> bool:
        """A usable client (connecting, or probing a master that was down, when due)."""
        if self._client is not None and self.stats.available:
            return True
        if time.monotonic() < self._down_until:
            return False
        if self._client is None:
            return self._connect()
        probe = self._client.batch_is_exist([self.prefix + "probe"])
        if probe and probe[0] >= 0:
            self._up()
            return True
        self._down("it does not answer")
        return False

    def _connect(self) -> bool:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # the wheel is a dependency of the cluster install
            self._down(f"mooncake is not installed ({e})")
            return False
        if not bind_host.shim_loaded():
            logger.warning(
                "KV store client of this process listens on the wildcard address (no bind shim): run it "
                "as an engine process of xllm serve / cluster, which confines it to kv_tiers.store_host"
            )
        client = MooncakeDistributedStore()
        rc = client.setup(self.host, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.master)
        if rc != 0:
            self._down(f"setup returned {rc}")
            return False
        if client.register_buffer(self.staging.data_ptr(), self.staging.nbytes) != 0:
            self._down("registering the staging buffer failed")
            return False
        self._client = client
        self._up()
        return True

    def _up(self) -> None:
        if self._warned:
            logger.warning("KV store at %s is back: L3 store hits resume", self.master)
        self.stats.available, self._warned = True, False

    def _down(self, why: str) -> None:
        self.stats.errors += 1
        self.stats.available = False
        self._down_until = time.monotonic() + self.retry_s
        if not self._warned:
            logger.warning(
                "KV store at %s is unreachable (%s): serving from L1/L2 and disk only, retrying every %.0fs",
                self.master, why, self.retry_s,
            )  # fmt: skip
            self._warned = True

    def _keys(self, keys: list[int]) -> list[str]:
        return [f"{self.prefix}{k:016x}" for k in keys]

    # ------------------------------------------------------------------ tier
    def contains(self, keys: list[int]) -> list[bool]:
        if not self._connected() or not keys:
            return [False] * len(keys)
        rcs = self._client.batch_is_exist(self._keys(keys))
        if any(rc < 0 for rc in rcs):
            self._down(f"existence check returned {min(rcs)}")
            return [False] * len(keys)
        return [rc == 1 for rc in rcs]

    def put(self, key: int, record: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        self.put_many([key], record.view(1, -1))
        return []

    def put_many(self, keys: list[int], records: torch.Tensor) -> None:
        """Store ``records[i]`` under ``keys[i]`` in batches (a key held already is left as it is)."""
        for first in range(0, len(keys), self.batch_blocks):
            if not self._connected():
                return
            part = keys[first : first + self.batch_blocks]
            n = len(part)
            self.staging[:n].copy_(records[first : first + n])
            base, rb = self.staging.data_ptr(), self.record_bytes
            rcs = self._client.batch_put_from(self._keys(part), [base + i * rb for i in range(n)], [rb] * n)
            self.changed([k for k, rc in zip(part, rcs) if rc == 0], [])
            stored = sum(1 for rc in rcs if rc == 0)
            self.stats.writes += stored
            self.stats.bytes_written += stored * rb
            self.stats.num_blocks += stored
            if any(rc < 0 and rc != _EXISTS for rc in rcs):
                self._down(f"put returned {min(rcs)}")
                return

    def _get_into(self, keys: list[int], out: torch.Tensor) -> int:
        done = 0
        for first in range(0, len(keys), self.batch_blocks):
            if not self._connected():
                return done
            part = keys[first : first + self.batch_blocks]
            n, base, rb = len(part), self.staging.data_ptr(), self.record_bytes
            rcs = self._client.batch_get_into(self._keys(part), [base + i * rb for i in range(n)], [rb] * n)
            run = next((i for i, rc in enumerate(rcs) if rc != rb), n)
            out[first : first + run].copy_(self.staging[:run])
            done += run
            if run < n:
                bad = rcs[run]
                if bad < 0 and bad != _NOT_FOUND:
                    self._down(f"get returned {bad}")
                return done
        return done

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._client = None
