"""Helpers of the KV tier unit tests: records, a reader, on-disk damage (the ``disks`` fixture is in
``conftest.py``)."""

from __future__ import annotations

import torch

from memory.kv_tiers.disk import _SLOT_HEADER

RB = 256  # record bytes


def rec(seed, nbytes=RB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def get(tier, keys, nbytes=RB):
    out = torch.zeros((len(keys), nbytes), dtype=torch.uint8)
    return tier.get_into(keys, out), out


def damage(disk, key, at=0):
    """Flip bytes of ``key``'s record in the file, ``at`` bytes into the record."""
    pos = disk._offset(disk._slots[key]) + _SLOT_HEADER.size + at
    with open(disk.path, "r+b") as f:
        f.seek(pos)
        old = f.read(4)
        f.seek(pos)
        f.write(bytes(b ^ 0xFF for b in old))
