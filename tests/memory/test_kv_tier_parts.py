"""KV tiers one by one (``memory/kv_tiers/``): the host tier's LRU, the disk tier's checksums, recovery and
lock."""

import os

import pytest
import torch

from memory.kv_tiers.disk import _SLOT_HEADER
from memory.kv_tiers.host import HostTier
from tests.memory.kv_tiers_util import RB, damage, get, rec


# ---------------------------------------------------------------- HostTier
def test_host_lru_eviction_order_and_evicted_bytes():
    host = HostTier(RB, capacity_blocks=3)
    for k in (1, 2, 3):
        assert host.put(k, rec(k)) == []
    assert get(host, [1])[0] == 1  # 1 is now most recently used: LRU order 2, 3, 1
    ev = host.put(4, rec(4))
    assert [k for k, _ in ev] == [2]
    assert torch.equal(ev[0][1], rec(2))
    ev = host.put(5, rec(5))
    assert [k for k, _ in ev] == [3]
    assert torch.equal(ev[0][1], rec(3))
    ev = host.put(6, rec(6))
    assert [k for k, _ in ev] == [1]
    assert torch.equal(ev[0][1], rec(1))
    assert host.contains([1, 2, 3, 4, 5, 6]) == [False, False, False, True, True, True]
    n, out = get(host, [4, 5, 6])
    assert n == 3
    for i, k in enumerate((4, 5, 6)):
        assert torch.equal(out[i], rec(k))


def test_host_put_of_held_key_refreshes_without_eviction():
    host = HostTier(RB, capacity_blocks=2)
    host.put(1, rec(1))
    host.put(2, rec(2))
    assert host.put(1, rec(99)) == []  # held: refreshed, not rewritten
    assert host.stats.writes == 2 and host.stats.evictions == 0
    assert torch.equal(host.get_view(1), rec(1))
    ev = host.put(3, rec(3))
    assert [k for k, _ in ev] == [2]  # 1 was refreshed, so 2 is the oldest
    assert host.contains([1, 2, 3]) == [True, False, True]


def test_host_get_into_leading_run_and_stats():
    host = HostTier(RB, capacity_blocks=2)
    host.put(1, rec(1))
    host.put(2, rec(2))
    host.put(3, rec(3))  # evicts 1
    host.put(4, rec(4))  # evicts 2
    n, out = get(host, [3, 4, 5, 3])
    assert n == 2  # stops at the first miss, although 3 is held again after it
    assert torch.equal(out[0], rec(3)) and torch.equal(out[1], rec(4))
    assert not out[2:].any()
    assert get(host, [1])[0] == 0
    s = host.stats
    assert (s.hits, s.misses, s.loads) == (2, 3, 2)
    assert s.bytes_read == 2 * RB
    assert (s.writes, s.bytes_written, s.evictions) == (4, 4 * RB, 2)
    assert (s.num_blocks, s.capacity_blocks) == (2, 2)


# ---------------------------------------------------------------- DiskTier
def test_disk_round_trip(disks):
    disk = disks(record_bytes=4096)
    assert disk.put(10, rec(10, 4096)) == []
    assert disk.put(11, rec(11, 4096)) == []
    assert disk.contains([10, 11, 12]) == [True, True, False]
    n, out = get(disk, [10, 11, 12], 4096)
    assert n == 2
    assert torch.equal(out[0], rec(10, 4096)) and torch.equal(out[1], rec(11, 4096))
    s = disk.stats
    assert (s.writes, s.bytes_written, s.hits, s.misses, s.corrupt) == (2, 2 * 4096, 2, 1, 0)


@pytest.mark.parametrize("at", [0, RB - 4])
def test_disk_corrupt_record_is_detected_and_dropped(disks, at):
    disk = disks()
    for k in (1, 2, 3):
        disk.put(k, rec(k))
    damage(disk, 2, at)
    n, out = get(disk, [1, 2, 3])
    assert n == 1
    assert torch.equal(out[0], rec(1))
    assert disk.stats.corrupt == 1
    assert disk.stats.num_blocks == 2
    assert disk.contains([1, 2, 3]) == [True, False, True]
    n, _ = get(disk, [2])  # now a plain miss
    assert n == 0 and disk.stats.corrupt == 1
    n, out = get(disk, [3])
    assert n == 1 and torch.equal(out[0], rec(3))


def test_disk_truncated_file_is_detected(disks):
    disk = disks()
    disk.put(1, rec(1))
    disk.put(2, rec(2))
    tail_zero = rec(3)
    tail_zero[RB // 2 :] = 0  # what is cut off is zeros: only the short read gives it away
    disk.put(3, tail_zero)
    cut = disk._offset(disk._slots[3]) + _SLOT_HEADER.size + RB // 2
    os.truncate(disk.path, cut)
    n, out = get(disk, [1, 2, 3])
    assert n == 2
    assert torch.equal(out[0], rec(1)) and torch.equal(out[1], rec(2))
    assert disk.stats.corrupt == 1
    assert disk.contains([3]) == [False]
    assert get(disk, [3])[0] == 0 and disk.stats.corrupt == 1


def test_disk_file_in_use_by_another_tier(disks):
    first = disks()
    with pytest.raises(ValueError, match="in use"):
        disks()
    first.close()
    second = disks()  # free again once closed
    assert second.contains([1]) == [False]


def test_disk_reopen_finds_last_run_only_for_same_fingerprint(disks):
    disk = disks(fingerprint=7)
    for k in (1, 2, 3):
        disk.put(k, rec(k))
    disk.close()
    again = disks(fingerprint=7)
    assert again.contains([1, 2, 3, 4]) == [True, True, True, False]
    assert again.stats.num_blocks == 3
    n, out = get(again, [1, 2, 3])
    assert n == 3 and again.stats.corrupt == 0
    for i, k in enumerate((1, 2, 3)):
        assert torch.equal(out[i], rec(k))
    again.close()
    other = disks(fingerprint=8)
    assert other.contains([1, 2, 3]) == [False, False, False]
    assert other.stats.num_blocks == 0
    assert get(other, [1])[0] == 0


def test_disk_lru_eviction_when_full(disks):
    disk = disks(capacity=2)
    disk.put(1, rec(1))
    disk.put(2, rec(2))
    assert get(disk, [1])[0] == 1  # 2 is now the least recently used
    assert disk.put(3, rec(3)) == []
    assert disk.contains([1, 2, 3]) == [True, False, True]
    assert disk.stats.evictions == 1 and disk.stats.num_blocks == 2
    n, out = get(disk, [1, 3])
    assert n == 2
    assert torch.equal(out[0], rec(1)) and torch.equal(out[1], rec(3))
