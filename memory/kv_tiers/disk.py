"""L3 on local disk: one file of fixed-size slots, each a block record behind a checksummed header.

The file starts with a header naming its geometry and the KV layout's fingerprint; a file of another
geometry or layout is started afresh. Slot headers carry the key, the length and a CRC-32 of the record,
so a restarted instance finds what its last run wrote, and a block corrupted or cut short on disk is
detected on load, dropped and counted (``corrupt``), never served: the prompt recomputes it. The file is
locked (``flock``) while open: two instances cannot share one (give each its own ``disk_path``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from memory.kv_tiers.base import KVTier

logger = logging.getLogger(__name__)

_FILE_MAGIC = b"XLLMKVT1"
_FILE_HEADER = struct.Struct("<8sQQQ")  # magic, record bytes, slots, layout fingerprint
_SLOT_MAGIC = b"XKVB"
_SLOT_HEADER = struct.Struct("<4sIQII8x")  # magic, pad, key, record length, crc32 (32 bytes)
_ALIGN = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class DiskTier(KVTier):
    name = "disk"

    def __init__(self, path: str | Path, record_bytes: int, capacity_blocks: int, fingerprint: int) -> None:
        super().__init__(record_bytes)
        if capacity_blocks < 1:
            raise ValueError("the disk KV tier needs room for at least one block")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_blocks
        self.slot_bytes = _round_up(_SLOT_HEADER.size + record_bytes, _ALIGN)
        self.fingerprint = fingerprint & (2**64 - 1)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ValueError(
                f"kv_tiers.disk_path: {self.path} is in use by another engine process; give each instance "
                "(and each data-parallel rank) a file of its own"
            ) from None
        self._slots: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recently used first
        self._free: list[int] = []
        self._header = bytearray(_SLOT_HEADER.size)
        self._open()
        self.stats.capacity_blocks = capacity_blocks

    def _open(self) -> None:
        want = _FILE_HEADER.pack(_FILE_MAGIC, self.record_bytes, self.capacity, self.fingerprint)
        have = os.pread(self._fd, _FILE_HEADER.size, 0)
        size = _ALIGN + self.capacity * self.slot_bytes
        if have == want and os.fstat(self._fd).st_size >= _ALIGN:
            self._recover()
        else:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, want, 0)
        os.ftruncate(self._fd, size)
        used = set(self._slots.values())
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]

    def _recover(self) -> None:
        """Index the slots a previous run of this file wrote (their records are checked on load)."""
        for slot in range(self.capacity):
            raw = os.pread(self._fd, _SLOT_HEADER.size, self._offset(slot))
            if len(raw) < _SLOT_HEADER.size:
                break
            magic, _, key, length, _ = _SLOT_HEADER.unpack(raw)
            if magic == _SLOT_MAGIC and length == self.record_bytes and key not in self._slots:
                self._slots[key] = slot
        if self._slots:
            logger.info("disk KV tier %s: %d blocks from its last run", self.path, len(self._slots))
        self.stats.num_blocks = len(self._slots)

    def _offset(self, slot: int) -> int:
        return _ALIGN + slot * self.slot_bytes

    def contains(self, keys: list[int]) -> list[bool]:
        return [k in self._slots for k in keys]

    def put(self, key: int, record: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        if key in self._slots:
            self._slots.move_to_end(key)
            return []
        dropped = []
        if self._free:
            slot = self._free.pop()
        else:
            old, slot = self._slots.popitem(last=False)
            dropped.append(old)
            self.stats.evictions += 1
        data = memoryview(record.numpy())
        header = _SLOT_HEADER.pack(_SLOT_MAGIC, 0, key, self.record_bytes, zlib.crc32(data))
        try:
            os.pwritev(self._fd, [header, data], self._offset(slot))
        except OSError as e:
            self._free.append(slot)
            self.stats.errors += 1
            logger.warning("disk KV tier %s: write failed (%s); the block stays uncached here", self.path, e)
            self.changed([], dropped)
            return []
        self._slots[key] = slot
        self.stats.writes += 1
        self.stats.bytes_written += self.record_bytes
        self.stats.num_blocks = len(self._slots)
        self.changed([key], dropped)
        return []

    def _get_into(self, keys: list[int], out: torch.Tensor) -> int:
        for i, key in enumerate(keys):
            slot = self._slots.get(key)
            if slot is None or not self._read(key, slot, out[i]):
                return i
            self._slots.move_to_end(key)
        return len(keys)

    def _read(self, key: int, slot: int, out: torch.Tensor) -> bool:
        data = memoryview(out.numpy())
        try:
            got = os.preadv(self._fd, [self._header, data], self._offset(slot))
        except OSError as e:
            self.stats.errors += 1
            logger.warning("disk KV tier %s: read failed (%s)", self.path, e)
            got = -1
        ok = got == _SLOT_HEADER.size + self.record_bytes
        if ok:
            magic, _, k, length, crc = _SLOT_HEADER.unpack(self._header)
            ok = magic == _SLOT_MAGIC and k == key and length == self.record_bytes and crc == zlib.crc32(data)
        if not ok:  # cut short or corrupted: never served; the slot is free again
            self.stats.corrupt += 1
            del self._slots[key]
            self._free.append(slot)
            self.stats.num_blocks = len(self._slots)
            self.changed([], [key])
            logger.warning("disk KV tier %s: block %016x failed its checksum; recomputing it", self.path, key)
        return ok

    def held(self) -> list[int]:
        return list(self._slots)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
