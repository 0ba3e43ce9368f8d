from memory.block_pool import BlockPool
from memory.prefix_cache import RadixPrefixCache

BS = 4


def _cache(num_blocks=16):
    pool = BlockPool(num_blocks)
    return pool, RadixPrefixCache(pool, BS)


def test_match_insert_whole_blocks_only():
    pool, cache = _cache()
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    blocks = pool.allocate(3)
    assert cache.insert(tokens[:8], blocks[:2]) == 2
    assert cache.match(tokens).block_ids == blocks[:2]
    assert cache.match(tokens, max_blocks=1).block_ids == blocks[:1]
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9]).block_ids == blocks[:1]
    assert cache.match([7] * 8).block_ids == []


def test_branching_and_duplicate_insert_keeps_existing():
    pool, cache = _cache()
    a = pool.allocate(2)
    cache.insert([1] * 4 + [2] * 4, a)
    b = pool.allocate(2)
    added = cache.insert([1] * 4 + [3] * 4, b)  # shares block 0's prefix
    assert added == 1
    assert cache.match([1] * 4 + [3] * 4).block_ids == [a[0], b[1]]
    assert not pool.cached[b[0]]  # duplicate stays uncached
    assert cache.num_cached_blocks == 3


def test_evicting_a_node_drops_its_subtree():
    pool, cache = _cache(4)
    blocks = pool.allocate(3)
    cache.insert(list(range(12)), blocks)
    pool.free(list(reversed(blocks)))
    # the pool hands out the LRU head (the leaf) first; taking all blocks empties the cache
    pool.allocate(4)
    assert cache.num_cached_blocks == 0
    assert cache.match(list(range(12))).block_ids == []


def test_lock_pins_blocks():
    pool, cache = _cache(2)
    blocks = pool.allocate(2)
    cache.insert(list(range(8)), blocks)
    pool.free(blocks)
    hit = cache.match(list(range(8)))
    cache.lock(hit.block_ids)
    assert pool.num_free_blocks == 0
    cache.unlock(hit.block_ids)
    assert pool.num_free_blocks == 2
    assert cache.reset()
    assert cache.num_cached_blocks == 0


def test_kv_events_carry_the_wire_block_hashes():
    """What the cache publishes is what the service's prefix index computes for the same prompt."""
    from xengine.api.block_hash import prompt_block_hashes

    pool, cache = _cache()
    events = []
    cache.event_sink = lambda stored, removed: events.append((stored, removed))
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    cache.insert(tokens[:12], pool.allocate(3))
    assert events == [(prompt_block_hashes(tokens, BS), [])]
    assert prompt_block_hashes([9] + tokens[1:], BS)[2] != events[0][0][2]  # the chain carries the prefix


def test_the_block_hash_is_defined_once():
    """One definition (``xengine/api/block_hash.py``) for the engine and the service, not two kept equal."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    defining = [
        str(path.relative_to(root))
        for package in ("memory", "ops", "graph", "xengine", "xservice")
        for path in sorted((root / package).rglob("*.py"))
        if "def block_hash(" in path.read_text()
    ]
    assert defining == ["xengine/api/block_hash.py"]
