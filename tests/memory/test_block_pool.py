import pytest

from memory.block_pool import BlockPool


def test_allocate_free_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1
    pool.touch(a[:1])
    pool.free(a)
    assert pool.num_free_blocks == 3  # a[0] still referenced once
    pool.free(a[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.free(a[:1])


def test_free_queue_is_lru_and_eviction_notifies():
    pool = BlockPool(3)
    evicted = []
    pool.on_evict = evicted.append
    blocks = pool.allocate(3)
    for b in blocks:
        pool.cached[b] = True
    pool.free([blocks[2], blocks[0], blocks[1]])  # eviction order
    assert pool.allocate(1) == [blocks[2]]
    assert evicted == [blocks[2]]
    assert pool.stats().num_cached_free_blocks == 2


def test_out_of_blocks():
    pool = BlockPool(2)
    with pytest.raises(MemoryError):
        pool.allocate(3)
