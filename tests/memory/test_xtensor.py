"""xTensor KV memory in a real engine: pages by state, prefix sharing by double mapping, reuse of
released slots, memory that follows tokens (not max_model_len), and the mapping budget."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from memory.xtensor import PageState
from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

BLOCK = 16


def _add(engine, req_id: str, prompt: list[int], max_tokens: int = 4) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))


def _xt(engine):
    return engine.kv_setup.layout


def test_a_prefix_hit_maps_the_same_physical_page_into_two_slots(tiny_qwen3: Path) -> None:
    engine = make_engine(tiny_qwen3, kv_layout="xtensor", block_size=BLOCK, num_blocks=128, max_model_len=256)
    layout = _xt(engine)
    prompt = random_prompts([5 * BLOCK + 3], seed=1)[0]
    _add(engine, "a", prompt, max_tokens=50)
    engine.step()  # a's prompt computed: its 5 whole blocks enter the prefix cache
    _add(engine, "b", prompt[: 4 * BLOCK + 7], max_tokens=50)
    engine.step()
    table_a, table_b = engine.kv.block_tables["a"], engine.kv.block_tables["b"]
    assert table_a[:4] == table_b[:4]  # the hit: 4 whole blocks shared by reference
    slot_a, slot_b = layout.slots.slot_of["a"], layout.slots.slot_of["b"]
    assert slot_a != slot_b
    for j in range(4):  # bookkeeping: each shared page is mapped at the same position of both slots
        block = table_a[j]
        assert layout.slots.mapped[slot_a][j] == layout.slots.mapped[slot_b][j] == block
        assert layout.num_mappings[block] == 2
        assert layout.page_state(block, engine.kv.pool.ref_cnt[block]) is PageState.MAPPED
    # the bytes: write through a's slot, read through b's slot and through the paged view
    cache = layout.caches[1]
    per = layout.slots_per_chunk
    ka = cache.k_chunks[slot_a // per][slot_a % per]
    kb = cache.k_chunks[slot_b // per][slot_b % per]
    assert torch.equal(ka[: 4 * BLOCK], kb[: 4 * BLOCK])
    ka[BLOCK + 3] = 42.0
    assert torch.all(kb[BLOCK + 3] == 42.0)
    assert torch.all(cache.paged[0, table_a[1], 3] == 42.0)


def test_released_slots_keep_their_mappings_and_a_second_wave_maps_nothing(tiny_qwen3: Path) -> None:
    """64 sequences of 100 tokens; finished, their pages are reusable; 64 more map no new page."""
    engine = make_engine(
        tiny_qwen3, kv_layout="xtensor", block_size=BLOCK, num_blocks=1024, max_num_seqs=64,
        enable_prefix_caching=False, max_num_batched_tokens=8192,
    )  # fmt: skip
    free_at_start = engine.kv.num_free_blocks
    for wave in range(2):
        for i, prompt in enumerate(random_prompts([100] * 64, seed=10 + wave)):
            _add(engine, f"w{wave}-{i}", prompt, max_tokens=10)
        run_to_completion(engine)
        stats = engine.get_stats().xtensor
        if wave == 0:
            maps_after_first = stats.num_maps
            assert stats.num_reusable > 0 and stats.num_mapped == 0 and stats.num_allocated == 0
    assert stats.num_maps == maps_after_first  # nothing new mapped: every page reused in place
    assert stats.num_unmaps == 0
    assert_engine_idle(engine, free_at_start)


def _rss_shmem_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


@pytest.mark.parametrize("max_model_len", [32768])
def test_memory_follows_tokens_not_max_model_len(make_config_variant, max_model_len: int) -> None:
    """max_model_len 32k, 64 sequences of 100 tokens: resident KV memory is the pages the tokens
    occupy (whole blocks), not 64 x 32k tokens."""
    model = make_config_variant("long-ctx", {"max_position_embeddings": max_model_len})
    engine = make_engine(
        model, kv_layout="xtensor", block_size=BLOCK, num_blocks=2048, max_num_seqs=64,
        max_model_len=max_model_len, enable_prefix_caching=False, max_num_batched_tokens=8192,
    )  # fmt: skip
    layout = _xt(engine)
    gc.collect()  # an earlier test's engine freed now, not while this one is measured
    before = _rss_shmem_bytes()
    for i, prompt in enumerate(random_prompts([100] * 64, seed=3)):
        _add(engine, f"r{i}", prompt, max_tokens=2)
    engine.step()  # every prompt computed: 64 x 100 tokens held
    written = 64 * -(-100 // BLOCK)  # blocks holding tokens (look-ahead blocks are not touched yet)
    block_bytes = layout.num_streams * layout.page_bytes
    grown = _rss_shmem_bytes() - before
    token_bytes = 64 * 100 * layout.num_streams * layout.token_bytes
    ratio = grown / (written * block_bytes)
    print(f"RssShmem grew {grown} B for {written} blocks of {block_bytes} B: ratio {ratio:.3f}; "
          f"{grown / token_bytes:.3f} x the tokens' KV bytes")  # fmt: skip
    assert 0.95 <= ratio <= 1.05, (grown, written * block_bytes)  # the written blocks, page for page
    assert grown < 1.5 * token_bytes  # about the tokens' bytes (whole blocks: 112 of 100 tokens)
    slot_capacity = 64 * max_model_len * layout.num_streams * layout.token_bytes
    assert grown < slot_capacity / 100  # vs a contiguous allocation of max_model_len per sequence
    run_to_completion(engine)


def test_mapping_budget_evicts_released_slots_first(tiny_qwen3: Path) -> None:
    engine = make_engine(
        tiny_qwen3, kv_layout="xtensor", block_size=BLOCK, num_blocks=256, max_num_seqs=8,
        enable_prefix_caching=False,
    )  # fmt: skip
    layout = _xt(engine)
    for i, prompt in enumerate(random_prompts([60] * 8, seed=5)):
        _add(engine, f"a{i}", prompt)
    run_to_completion(engine)  # 8 released slots, each still mapping its pages
    live = layout.num_live_mappings
    layout._budget = live  # no room for anything new: released slots' mappings must go
    _add(engine, "b", random_prompts([200], seed=6)[0])
    run_to_completion(engine)
    stats = engine.get_stats().xtensor
    assert stats.num_unmaps > 0 and layout.num_live_mappings <= live


def _num_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_a_dropped_engine_gives_back_its_mappings(tiny_qwen3: Path) -> None:
    """Nobody closes an ``LLM`` / engine explicitly: once it is gone its ranges are unmapped and its
    memfd closed, so engine after engine in one process never runs out of ``vm.max_map_count``."""
    import os

    gc.collect()
    before, fds_before = _num_mappings(), len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        engine = make_engine(tiny_qwen3, kv_layout="xtensor", block_size=BLOCK, num_blocks=256)
        for i, prompt in enumerate(random_prompts([3 * BLOCK + 1] * 8, seed=2)):
            _add(engine, f"r{i}", prompt, max_tokens=20)
        run_to_completion(engine)
        assert _num_mappings() > before + 8  # its pages really were mapped
        del engine
        gc.collect()
        assert _num_mappings() <= before + 2  # (a little slack for allocator arenas)
    assert len(os.listdir("/proc/self/fd")) <= fds_before
