"""KV tiers of hybrid models (``xengine/tiered_hybrid.py``): the sliding-window models (tiny Gemma 3 and
MiMo-V2-Flash, window 32) and the recurrent ones (tiny Qwen3-Next and Nemotron-H) resume a prompt from
the tiers with greedy tokens equal to an engine without tiers: the window models wherever the window
blocks a query there reads were stored (checkpoints, and where a sequence ended), the recurrent ones at
their last state snapshot. The L1 pool is emptied in between, so every hit comes from the tiers (host,
disk, or the Mooncake Store across two engines); a corrupted snapshot is never served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.kv_store import StoreServer
from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

BS = 16
EVERY = 32  # state_snapshot_interval: a checkpoint each 2 blocks
SETTINGS = {
    "block_size": BS,
    "num_blocks": 96,
    "max_model_len": 512,
    "seed": 0,
    "state_snapshot_interval": EVERY,
}
MAX_TOKENS = 8
PROMPTS = random_prompts([150, 70, 230, 20], seed=5)  # the last: shorter than a checkpoint
ARCHS = ["gemma3", "mimo_v2_flash", "qwen3_next", "nemotron_h"]


def _generate(engine: Any, req_id: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
    return [t for d in run_to_completion(engine) for t in d.new_token_ids]


def _settle(engine: Any) -> None:
    while engine.tiers.busy:
        engine.tiers.poll(False, {})
    engine.tiers.poll(False, {})


def _computed(engine: Any) -> int:
    return engine.get_stats().num_computed_prompt_tokens


def _resume_blocks(n: int, arch: str = "qwen3_next") -> int:
    """Blocks a prompt of ``n`` tokens resumes after from the tiers (a token is always left to compute):
    a recurrent model's last snapshot; a window model's last block (each prompt's first pass ended
    there, and its window was stored where it ended)."""
    whole = (n - 1) // BS
    return whole if arch in ("gemma3", "mimo_v2_flash") else whole // (EVERY // BS) * (EVERY // BS)


@pytest.fixture(scope="module")
def references(make_model_dir: Any) -> dict[str, list[list[int]]]:
    out = {}
    for arch in ARCHS:
        engine = make_engine(make_model_dir(arch), **SETTINGS)
        out[arch] = [_generate(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_prompts_resume_from_the_tiers(
    make_model_dir: Any, tmp_path: Path, references: Any, arch: str
) -> None:
    tiers = (
        dict(host_memory_gb=0.02)
        if arch in ("gemma3", "qwen3_next")
        else dict(disk_path=str(tmp_path / "arena"), disk_gb=0.02)
    )
    engine = make_engine(make_model_dir(arch), **SETTINGS, **tiers)
    free = engine.kv.num_free_blocks
    assert [_generate(engine, f"a{i}", p) for i, p in enumerate(PROMPTS)] == references[arch]
    _settle(engine)
    stats = engine.get_stats().kv_tiers
    assert stats.num_saved_states + stats.num_saved_window_blocks > 0
    assert engine.reset_prefix_cache()  # L1 (and its windows and snapshots) empty
    for i, prompt in enumerate(PROMPTS):
        before = _computed(engine)
        assert _generate(engine, f"b{i}", prompt) == references[arch][i], f"prompt {i} differs"
        resumed = _resume_blocks(len(prompt), arch)
        assert _computed(engine) - before == len(prompt) - resumed * BS, f"prompt {i}"
    stats = engine.get_stats().kv_tiers
    assert stats.num_loaded_checkpoints == sum(1 for p in PROMPTS if _resume_blocks(len(p), arch))
    assert stats.num_loaded_blocks == sum(_resume_blocks(len(p), arch) for p in PROMPTS)
    _settle(engine)
    engine.reset_prefix_cache()
    assert_engine_idle(engine, free)
    engine.shutdown()


@pytest.mark.parametrize("arch", ["mimo_v2_flash", "qwen3_next"])
def test_hybrid_prompts_shared_through_the_store(make_model_dir: Any, references: Any, arch: str) -> None:
    store = StoreServer()
    try:
        tiers = dict(store_master=store.master)
        first = make_engine(make_model_dir(arch), **SETTINGS, **tiers)
        assert [_generate(first, f"a{i}", p) for i, p in enumerate(PROMPTS)] == references[arch]
        _settle(first)
        first.shutdown()
        second = make_engine(make_model_dir(arch), **SETTINGS, **tiers)
        for i, prompt in enumerate(PROMPTS):
            before = _computed(second)
            assert _generate(second, f"b{i}", prompt) == references[arch][i], f"prompt {i} differs"
            resumed = _resume_blocks(len(prompt), arch)
            assert _computed(second) - before == len(prompt) - resumed * BS
        loaded = second.get_stats().kv_tiers.num_loaded_checkpoints
        assert loaded == sum(1 for p in PROMPTS if _resume_blocks(len(p), arch))
        second.shutdown()
    finally:
        store.stop()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_next"])
def test_hybrid_write_back_under_l1_pressure(make_model_dir: Any, arch: str) -> None:
    """write_back: full blocks reach the host tier when L1 evicts them, checkpoints as they are made; a
    second pass over more prompts than L1 holds resumes from the host tier with the same tokens."""
    many = random_prompts([200] * 6, seed=13)
    settings = {**SETTINGS, "num_blocks": 48}
    base = make_engine(make_model_dir(arch), **settings)
    want = [_generate(base, f"r{i}", p) for i, p in enumerate(many)]
    engine = make_engine(make_model_dir(arch), **settings, host_memory_gb=0.02, write_policy="write_back")
    assert [_generate(engine, f"a{i}", p) for i, p in enumerate(many)] == want
    _settle(engine)
    assert [_generate(engine, f"b{i}", p) for i, p in enumerate(many)] == want
    stats = engine.get_stats().kv_tiers
    assert stats.num_loaded_checkpoints > 0 and stats.num_loaded_blocks > 0
    engine.shutdown()


def test_a_corrupted_state_snapshot_is_never_served(
    make_model_dir: Any, tmp_path: Path, references: Any
) -> None:
    """The snapshot each prompt resumes from garbled on disk: the full-attention blocks still load, but no
    hit is taken past what L1 resumes from (nothing): the prompts are recomputed, the same tokens."""
    path = tmp_path / "arena"
    arch = "qwen3_next"
    engine = make_engine(make_model_dir(arch), **SETTINGS, disk_path=str(path), disk_gb=0.02)
    assert [_generate(engine, f"a{i}", p) for i, p in enumerate(PROMPTS)] == references[arch]
    _settle(engine)
    disk = engine.tiers.stack.tiers[0]
    side = engine.tiers.sidecar
    garbled = 0
    with open(path, "r+b") as f:
        for key, slot in list(disk._slots.items()):
            if any(key in side.state_keys(h) for h in _checkpoint_hashes(engine)):
                f.seek(4096 + slot * disk.slot_bytes + 64 + 100)
                f.write(b"\xff" * 64)
                garbled += 1
    assert garbled == 3 * side.state_chunks  # the last checkpoint of each of three prompts (the ones probed)
    assert engine.reset_prefix_cache()
    for i, prompt in enumerate(PROMPTS):
        before = _computed(engine)
        assert _generate(engine, f"b{i}", prompt) == references[arch][i]
        assert _computed(engine) - before == len(prompt)  # recomputed whole: no checkpoint served
    stats = engine.get_stats().kv_tiers
    assert stats.num_loaded_checkpoints == 0
    assert next(t for t in stats.tiers if t.name == "disk").corrupt >= 3
    engine.shutdown()


def _checkpoint_hashes(engine: Any) -> list[int]:
    """The chained hashes of the last checkpoint of each of ``PROMPTS`` that has one."""
    from xengine.api.block_hash import prompt_block_hashes

    out = []
    for p in PROMPTS:
        k = _resume_blocks(len(p))
        if k:
            out.append(prompt_block_hashes(p[: k * BS], BS)[k - 1])
    return out


@pytest.mark.parametrize("arch", ["gemma3", "mimo_v2_flash"])
def test_window_blocks_stored_only_where_a_hit_resumes(
    make_model_dir: Any, references: Any, arch: str
) -> None:
    """Checkpoints every 4 blocks (the default: twice the 2-block window): the tiers get the window
    blocks of each checkpoint's window and of where each sequence ended, not of every block; a chat's
    next turn (the last prompt, its answer and new tokens) resumes from the tiers exactly where the last
    turn ended, another prompt sharing part of it at the last checkpoint within the shared part."""
    settings = SETTINGS
    engine = make_engine(make_model_dir(arch), **settings, host_memory_gb=0.02)
    assert engine.tiers.sidecar.window_every == 4
    prompt = PROMPTS[0]
    answer = _generate(engine, "t1", prompt)
    assert answer == references[arch][0]
    _settle(engine)
    ended = (len(prompt) + MAX_TOKENS - 1) // BS  # blocks the first turn cached (its last token never ran)
    stats = engine.get_stats().kv_tiers
    assert stats.num_saved_blocks == ended
    # checkpoints at blocks 4 and 8 (windows [2, 4) and [6, 8)) and the end at 9 (window [7, 9)): 5 of
    # the 9 blocks' windows stored (block 7 handed over twice, stored once)
    assert stats.num_saved_window_blocks == 2 + 2 + 2
    host = next(t for t in stats.tiers if t.name == "host")
    assert host.writes == ended + 5 * engine.tiers.sidecar.window_chunks
    assert engine.reset_prefix_cache()
    follow = prompt + answer + random_prompts([40], seed=9)[0]
    base = make_engine(make_model_dir(arch), **settings)
    want = _generate(base, "f", follow)
    before = _computed(engine)
    assert _generate(engine, "t2", follow) == want
    assert _computed(engine) - before == len(follow) - ended * BS  # resumed where the first turn ended
    assert engine.get_stats().kv_tiers.num_loaded_checkpoints == 1
    assert engine.reset_prefix_cache()
    other = prompt[: 7 * BS + 5] + random_prompts([30], seed=10)[0]  # shares 7 whole blocks
    want = _generate(base, "o", other)
    before = _computed(engine)
    assert _generate(engine, "t3", other) == want
    # windows kept: [2, 4) and [6, 8) (checkpoints 4 and 8), [7, 9) (the end at 9): 7's window [5, 7) is
    # not whole, nor 6's or 5's; the checkpoint at 4 is
    assert _computed(engine) - before == len(other) - 4 * BS
    engine.shutdown()
    base.shutdown()
