"""Block records, the tier stack's write policies, probes and loads, and the tier worker (``memory/kv_tiers/``)."""

import threading

import pytest
import torch

from memory.kv_tiers.host import HostTier
from memory.kv_tiers.records import BlockRecords
from memory.kv_tiers.stack import TierStack
from memory.kv_tiers.worker import TierWorker
from tests.memory.kv_tiers_util import RB, damage, get, rec


# ---------------------------------------------------------------- BlockRecords
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_block_records_gather_scatter_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    shape = (2, 6, 4, 2, 8)  # [2, num_blocks, block_size, heads, head_dim]
    if dtype == torch.int8:
        caches = [torch.randint(-128, 128, shape, dtype=dtype, generator=g) for _ in range(3)]
    else:
        caches = [torch.randn(shape, generator=g) for _ in range(3)]
    before = [c.clone() for c in caches]
    br = BlockRecords(caches)
    block_bytes = 4 * 2 * 8 * caches[0].element_size()
    assert br.block_bytes == block_bytes and br.record_bytes == 3 * 2 * block_bytes
    records = br.gather([1, 4, 2])
    assert records.shape == (3, br.record_bytes) and records.dtype == torch.uint8
    layout = records.view(3, 3, 2, block_bytes)  # [block, layer, K/V, bytes]
    for layer in range(3):
        for kv in range(2):
            assert torch.equal(layout[0, layer, kv], before[layer][kv, 1].reshape(-1).view(torch.uint8))
    br.scatter([0, 5, 3], records)
    for layer, c in enumerate(caches):
        assert torch.equal(c[:, 0], before[layer][:, 1])
        assert torch.equal(c[:, 5], before[layer][:, 4])
        assert torch.equal(c[:, 3], before[layer][:, 2])
        for b in (1, 2, 4):
            assert torch.equal(c[:, b], before[layer][:, b])


# ---------------------------------------------------------------- TierStack
def test_stack_write_through_puts_everywhere(disks):
    host, disk = HostTier(RB, 4), disks()
    stack = TierStack([host, disk], "write_through")
    keys = [1, 2]
    stack.save(keys, torch.stack([rec(k) for k in keys]))
    assert host.contains(keys) == [True, True]
    assert disk.contains(keys) == [True, True]
    n, out = get(disk, keys)
    assert n == 2 and torch.equal(out[0], rec(1)) and torch.equal(out[1], rec(2))


def test_stack_write_back_passes_host_evictions_down(disks):
    host, disk = HostTier(RB, 2), disks()
    stack = TierStack([host, disk], "write_back")
    stack.save([1, 2], torch.stack([rec(1), rec(2)]))
    assert host.contains([1, 2]) == [True, True]
    assert disk.contains([1, 2]) == [False, False]
    stack.save([3], rec(3).view(1, -1))  # evicts 1 from host
    assert host.contains([1, 2, 3]) == [False, True, True]
    assert disk.contains([1, 2, 3]) == [True, False, False]
    n, out = get(disk, [1])
    assert n == 1 and torch.equal(out[0], rec(1))


def test_stack_probe_leading_run_local_first(disks):
    host, disk = HostTier(RB, 8), disks(capacity=8)
    for k in (10, 12, 14):
        host.put(k, rec(k))
    for k in (11, 12):
        disk.put(k, rec(k))
    stack = TierStack([host, disk])
    assert stack.probe([10, 11, 12, 13, 14]).tiers == [0, 1, 0]
    assert stack.probe([10, 11, 12]).num_blocks == 3
    assert stack.probe([13, 10, 11]).tiers == []
    assert stack.probe([11, 10]).tiers == [1, 0]


def test_stack_load_promotes_disk_blocks_into_host(disks):
    host, disk = HostTier(RB, 8), disks(capacity=8)
    host.put(1, rec(1))
    disk.put(2, rec(2))
    disk.put(3, rec(3))
    stack = TierStack([host, disk])
    keys = [1, 2, 3]
    probe = stack.probe(keys)
    assert probe.tiers == [0, 1, 1]
    out = torch.zeros((3, RB), dtype=torch.uint8)
    assert stack.load(keys, probe, out) == 3
    for i, k in enumerate(keys):
        assert torch.equal(out[i], rec(k))
    assert host.contains(keys) == [True, True, True]
    assert torch.equal(host.get_view(2), rec(2)) and torch.equal(host.get_view(3), rec(3))
    assert stack.probe(keys).tiers == [0, 0, 0]
    assert (disk.stats.hits, host.stats.hits) == (2, 1)


def test_stack_load_stops_at_corrupt_disk_block(disks):
    host, disk = HostTier(RB, 8), disks(capacity=8)
    keys = [1, 2, 3, 4]
    for k in keys:
        disk.put(k, rec(k))
    damage(disk, 3)
    stack = TierStack([host, disk])
    probe = stack.probe(keys)
    assert probe.tiers == [1, 1, 1, 1]
    out = torch.zeros((4, RB), dtype=torch.uint8)
    assert stack.load(keys, probe, out) == 2
    assert torch.equal(out[0], rec(1)) and torch.equal(out[1], rec(2))
    assert host.contains(keys) == [True, True, False, False]
    assert disk.stats.corrupt == 1
    assert stack.probe(keys).tiers == [0, 0]


# ---------------------------------------------------------------- TierWorker
def collect(worker, n):
    got = []
    for _ in range(10):
        got += worker.poll(timeout=2.0)
        if len(got) >= n:
            break
    return got


def test_worker_runs_jobs_in_order_on_its_thread():
    worker = TierWorker()
    ran = []

    def job(i):
        ran.append((i, threading.get_ident()))
        return i * 10

    for i in range(5):
        worker.submit(f"t{i}", lambda i=i: job(i))
    assert worker.num_pending == 5
    got = collect(worker, 5)
    assert got == [(f"t{i}", i * 10, None) for i in range(5)]
    assert [i for i, _ in ran] == list(range(5))
    assert all(t != threading.get_ident() for _, t in ran)
    assert worker.num_pending == 0
    worker.close()


def test_worker_reports_exception_and_keeps_running():
    worker = TierWorker()

    def boom():
        raise RuntimeError("disk gone")

    worker.submit("bad", boom)
    worker.submit("good", lambda: "ok")
    got = collect(worker, 2)
    assert len(got) == 2
    tag, result, err = got[0]
    assert (tag, result) == ("bad", None)
    assert isinstance(err, RuntimeError) and "disk gone" in str(err)
    assert got[1] == ("good", "ok", None)
    worker.close()


def test_worker_close_joins_after_pending_jobs():
    worker = TierWorker()
    release = threading.Event()
    worker.submit("a", lambda: release.wait(5.0))
    worker.submit("b", lambda: "b")
    release.set()
    worker.close()
    assert not worker._thread.is_alive()
    assert worker.poll() == [("a", True, None), ("b", "b", None)]
