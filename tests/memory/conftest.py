"""Fixtures of the memory tests: ``disks``, disk KV tiers on temporary files, closed afterwards."""

from __future__ import annotations

import pytest

from memory.kv_tiers.disk import DiskTier
from tests.memory.kv_tiers_util import RB


@pytest.fixture
def disks(tmp_path):
    opened = []

    def make(name="kv.bin", record_bytes=RB, capacity=4, fingerprint=1):
        d = DiskTier(tmp_path / name, record_bytes, capacity, fingerprint)
        opened.append(d)
        return d

    yield make
    for d in opened:
        d.close()
