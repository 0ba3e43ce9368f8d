"""The sliding-window pool beside the full-attention one (``memory/sliding_window.py``,
``memory/hybrid_kv_cache_manager.py``): release behind the window, bounded use, window-safe prefix
hits (taken, shortened, refused), forks, and both pools freed together."""

from __future__ import annotations

from memory.hybrid_kv_cache_manager import HybridKVCacheManager
from memory.sliding_window import NULL_BLOCK, SlidingWindowBlocks

BS = 4
WINDOW = 8  # a query at q reads keys q - 7 .. q: at most three 4-token blocks


def _manager(num_full: int = 64, num_window: int = 32, caching: bool = True) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_full, BS, caching, SlidingWindowBlocks(num_window, BS, WINDOW, caching))


def _run(kv: HybridKVCacheManager, seq: str, tokens: list[int], chunk: int) -> None:
    """Prefill ``tokens`` in chunks, caching full blocks as the scheduler does after each step."""
    done = 0
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert kv.allocate_slots(seq, done + n, num_computed=done)
        done += n
        kv.cache_blocks(seq, tokens, done)


def test_null_block_is_never_handed_out() -> None:
    w = SlidingWindowBlocks(4, BS, WINDOW, True)
    assert w.num_free_blocks == 3 and w.num_usable_blocks == 3
    assert NULL_BLOCK not in w.pool.allocate(3)


def test_blocks_behind_the_window_are_released_as_the_sequence_moves() -> None:
    kv = _manager()
    tokens = list(range(100))
    assert kv.allocate_slots("a", 40, num_computed=0)  # a 40-token chunk: all its blocks until it ran
    assert kv.window.num_held("a") == 10
    kv.cache_blocks("a", tokens, 40)
    for pos in range(40, 100):  # decode: one token a step
        assert kv.allocate_slots("a", pos + 1, num_computed=pos)
        table = kv.window.tables["a"]
        first = (pos - WINDOW + 1) // BS
        assert all(b == NULL_BLOCK for b in table[:first])
        assert all(b != NULL_BLOCK for b in table[first:])
        assert kv.window.num_held("a") <= -(-(WINDOW - 1) // BS) + 2  # bounded by the window
    assert len(kv.block_tables["a"]) == 25  # the full-attention table keeps everything
    kv.free("a")
    assert kv.window.num_free_blocks == kv.window.num_usable_blocks
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_window_pool_full_refuses_the_step_and_changes_nothing() -> None:
    kv = _manager(num_window=6)  # 5 usable blocks
    assert kv.allocate_slots("a", 16, num_computed=0)  # 4 blocks
    assert not kv.allocate_slots("b", 8, num_computed=0)  # 2 more: no room in the window pool
    assert "b" not in kv.block_tables and "b" not in kv.window.tables
    assert kv.num_free_blocks == kv.pool.num_blocks - 4
    assert kv.allocate_slots("a", 20, num_computed=16)  # releasing behind the window makes room
    assert kv.window.num_held("a") <= 3


def test_prefix_hit_with_its_window_resident_is_taken_whole() -> None:
    kv = _manager()
    tokens = list(range(40))
    _run(kv, "a", tokens, chunk=40)
    kv.free("a")  # its blocks stay cached in both pools
    prefix = kv.get_computed_prefix(tokens + [999])
    assert prefix.num_tokens == 40
    assert kv.allocate_slots("b", 41, prefix, num_computed=40)
    table = kv.window.tables["b"]
    first = (40 - WINDOW + 1) // BS
    assert table[:first] == [NULL_BLOCK] * first  # only the window came along
    assert all(b != NULL_BLOCK for b in table[first:])


def test_hit_is_shortened_when_its_window_was_released_and_reused() -> None:
    """Sequence ``a`` decodes far past its prompt: the prompt's window blocks were released while it
    ran and handed to another sequence, so a prompt-only hit is shortened to a length whose window
    is still mapped (the full-attention blocks alone would allow all of it)."""
    kv = _manager(num_window=12)  # 11 usable blocks
    prompt = list(range(100, 132))  # 8 blocks
    _run(kv, "a", prompt, chunk=32)
    for pos in range(32, 48):  # decode: the prompt's blocks fall behind the window and are released
        assert kv.allocate_slots("a", pos + 1, num_computed=pos)
    assert kv.allocate_slots("filler", 28, num_computed=0)  # takes the released, cached blocks
    full = kv.prefix_cache.match(prompt + [1], 8)
    assert full.num_blocks == 8  # the full-attention cache holds the whole prompt
    prefix = kv.get_computed_prefix(prompt + [1])
    assert prefix.num_tokens < 32
    k = prefix.num_tokens // BS
    first = max(0, prefix.num_tokens - WINDOW + 1) // BS
    assert all(b in kv.window.by_full for b in full.block_ids[first:k])  # what is taken is resident


def test_hit_is_refused_when_no_window_block_is_left() -> None:
    kv = _manager(num_window=12)  # 11 usable blocks
    prompt = list(range(200, 232))
    _run(kv, "a", prompt, chunk=32)
    kv.free("a")
    assert kv.allocate_slots("other", 44, num_computed=0)  # all 11: evicts every cached window block
    assert not kv.window.by_full
    assert kv.prefix_cache.match(prompt + [1], 8).num_blocks == 8
    assert kv.get_computed_prefix(prompt + [1]).num_tokens == 0


def test_a_cut_hit_is_window_safe_too() -> None:
    """A hit cut short (``limit_prefix``, for prompt logprobs) needs its own window: here the whole
    prompt's hit is usable (its last blocks are resident) but the cut one's window was evicted."""
    kv = _manager()  # 31 usable window blocks
    prompt = list(range(300, 340))  # 10 blocks, prefilled 8 tokens a step: blocks 0-5 released early
    _run(kv, "a", prompt, chunk=8)
    kv.free("a")
    # 21 never-used blocks, then the released ones in release order: 25 evict the windows of blocks 0-3
    assert kv.allocate_slots("other", 100, num_computed=0)
    whole = kv.get_computed_prefix(prompt + [1])
    assert whole.num_tokens == 40
    cut = type(whole)(whole.block_ids[:5], 20)
    assert kv.usable_prefix(cut).num_tokens == 0


def test_full_pool_eviction_forgets_the_window_mapping() -> None:
    kv = _manager(num_full=12)
    prompt = list(range(400, 440))  # 10 blocks
    _run(kv, "a", prompt, chunk=40)
    kv.free("a")
    assert kv.window.by_full
    assert kv.allocate_slots("b", 48, num_computed=0)  # all 12: the full pool evicts a's cached blocks
    assert not kv.window.by_full
    assert kv.window.num_free_blocks + kv.window.num_held("b") == kv.window.num_usable_blocks


def test_fork_shares_the_window_and_copies_the_partial_block() -> None:
    kv = _manager()
    _run(kv, "p", list(range(30)), chunk=30)
    assert kv.allocate_slots("p", 31, num_computed=30)
    before = kv.window.num_free_blocks
    assert kv.fork("p", "c", 30)
    parent, child = kv.window.tables["p"], kv.window.tables["c"]
    assert child[:-1] == parent[: len(child) - 1]
    assert child[-1] != parent[len(child) - 1]
    assert kv.window.take_pending_copies() == [(parent[len(child) - 1], child[-1])]
    assert kv.window.num_free_blocks == before - 1
    kv.free("p")
    kv.free("c")
    assert kv.window.num_free_blocks == kv.window.num_usable_blocks


def test_reset_clears_the_window_mapping() -> None:
    kv = _manager()
    _run(kv, "a", list(range(500, 540)), chunk=40)
    kv.free("a")
    assert kv.window.by_full
    assert kv.reset_prefix_cache()
    assert not kv.window.by_full


def test_release_lags_one_schedule_under_async_scheduling() -> None:
    """Async: the step scheduled before is still in flight (and may be undone and run again), so a
    schedule releases only behind the window of where the sequence stood the time before."""
    lagged = SlidingWindowBlocks(32, BS, WINDOW, True, release_lag=True)
    kv = HybridKVCacheManager(64, BS, True, lagged)
    assert kv.allocate_slots("a", 32, num_computed=0)  # step 1: a 32-token chunk
    assert kv.allocate_slots("a", 33, num_computed=32)  # step 2, scheduled while step 1 runs
    assert lagged.num_held("a") == 9  # step 1's queries (from position 0) still read every block
    assert kv.allocate_slots("a", 34, num_computed=33)
    first = (32 - WINDOW + 1) // BS  # behind step 2's window now: step 1 has been applied
    assert lagged.tables["a"][:first] == [NULL_BLOCK] * first
    assert all(b != NULL_BLOCK for b in lagged.tables["a"][first:])


def test_kv_events_publish_only_blocks_whose_window_is_held() -> None:
    """The cluster's index sees a block while both its full-attention block and its window block are
    cached, so the longest published run from a prompt's start is always a usable hit."""
    kv = _manager(num_window=12)  # 11 usable window blocks
    published: set[int] = set()

    def sink(stored: list[int], removed: list[int]) -> None:
        assert not (set(stored) & published) and set(removed) <= published
        published.update(stored)
        published.difference_update(removed)

    kv.set_event_sink(sink)
    prompt = list(range(600, 632))  # 8 blocks
    _run(kv, "a", prompt, chunk=32)
    hashes = [kv.prefix_cache.hash_of(b) for b in kv.block_tables["a"]]
    assert published == set(hashes)
    kv.free("a")  # tail first: the last blocks' windows are the first to go after the 3 unused ones
    assert kv.allocate_slots("b", 20, num_computed=0)  # 5 blocks: evicts the windows of blocks 7 and 6
    assert published == set(hashes[:6])
    # what the index would match from the prompt's start is what the instance itself can use
    assert kv.get_computed_prefix(prompt + [1]).num_tokens == 6 * BS
    kv.free("b")
    assert kv.reset_prefix_cache()
    assert not published
