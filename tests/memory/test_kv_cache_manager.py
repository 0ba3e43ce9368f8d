from memory.kv_cache_manager import KVCacheManager

BS = 4


def test_prefix_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BS)
    tokens = list(range(8))
    assert kv.allocate_slots("a", 8)
    kv.cache_blocks("a", tokens, 8)
    kv.free("a")
    prefix = kv.get_computed_prefix(tokens)  # whole prompt cached, but the last token must run
    assert prefix.num_tokens == 4
    prefix = kv.get_computed_prefix(tokens + [99])
    assert prefix.num_tokens == 8
    assert kv.allocate_slots("b", 9, prefix)
    assert kv.get_block_table("b")[:2] == prefix.block_ids
    kv.free("b")
    assert kv.num_free_blocks == 16


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(3, BS)
    assert kv.allocate_slots("a", 8)
    assert not kv.allocate_slots("b", 8)
    assert kv.get_block_table("b") == []
    assert kv.num_free_blocks == 1


def test_fork_shares_full_blocks_and_copies_partial():
    kv = KVCacheManager(8, BS)
    assert kv.allocate_slots("p", 6)
    parent = kv.get_block_table("p")
    assert kv.fork("p", "c", 6)
    child = kv.get_block_table("c")
    assert child[0] == parent[0] and child[1] != parent[1]
    assert kv.take_pending_copies() == [(parent[1], child[1])]
    assert kv.pool.ref_cnt[parent[0]] == 2
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 8


def test_blocks_to_cache_only_when_a_block_fills():
    """The scheduler asks before building a request's token list: yes only once a new block filled."""
    kv = KVCacheManager(16, BS)
    tokens = list(range(11))
    assert kv.allocate_slots("a", 11)
    assert not kv.has_blocks_to_cache("a", 3)
    assert kv.has_blocks_to_cache("a", 5)
    kv.cache_blocks("a", tokens, 5)
    assert [kv.has_blocks_to_cache("a", n) for n in (5, 6, 7, 8, 9)] == [False, False, False, True, True]
    kv.cache_blocks("a", tokens, 9)
    assert not kv.has_blocks_to_cache("a", 11)
    assert KVCacheManager(16, BS, enable_prefix_caching=False).has_blocks_to_cache("a", 8) is False
