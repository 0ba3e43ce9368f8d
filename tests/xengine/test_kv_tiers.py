"""KV tiers behind the prefix cache (``xengine/tiered_kv.py``): greedy tokens identical with the tiers on
and off for prompts served from each tier (host, disk, the Mooncake Store across instances), under each
write policy; a corrupted disk block recomputed, never served; a restarted instance finding its disk
tier; prefetch policies; the store's master killed mid-run. The store is a real ``mooncake_master``
with its memory (``xengine/process/kv_store_server.py``), started here."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kv_store import StoreServer
from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

BS = 16
PROMPTS = random_prompts([100, 150, 40, 200, 70], seed=7)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _settle(llm: LLM) -> None:
    """Let the tier worker finish its saves (their pins go)."""
    eng = llm.engine
    while eng.tiers is not None and eng.tiers.busy:
        eng.tiers.poll(False, {})
    if eng.tiers is not None:
        eng.tiers.poll(False, {})


def _tier(llm: LLM, name: str) -> Any:
    stats = llm.engine.get_stats().kv_tiers
    return next(t for t in stats.tiers if t.name == name)


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path) -> list[list[int]]:
    with LLM(str(tiny_qwen3), num_blocks=64, block_size=BS) as llm:
        return _tokens(llm)


@pytest.fixture
def store() -> Iterator[StoreServer]:
    server = StoreServer()
    yield server
    server.stop()


@pytest.mark.parametrize(
    "tiers",
    [
        pytest.param(dict(host_memory_gb=0.01), id="host"),
        pytest.param(dict(disk_gb=0.01), id="disk"),
        pytest.param(
            dict(host_memory_gb=0.01, disk_gb=0.01, write_policy="selective", write_min_hits=1),
            id="selective",
        ),
    ],
)
def test_prompts_served_from_a_tier_give_the_same_tokens(
    tiny_qwen3: Path, tmp_path: Path, reference: list[list[int]], tiers: dict[str, Any]
) -> None:
    if "disk_gb" in tiers:
        tiers = {**tiers, "disk_path": str(tmp_path / "arena")}
    with LLM(str(tiny_qwen3), num_blocks=64, block_size=BS, **tiers) as llm:
        assert _tokens(llm) == reference  # computed, written to the tiers
        if tiers.get("write_policy") == "selective":  # a block is written once hit: hit them first
            assert _tokens(llm) == reference
        _settle(llm)
        assert llm.engine.reset_prefix_cache()  # L1 empty: every hit must come from the tiers
        before = llm.engine.get_stats().num_computed_prompt_tokens
        assert _tokens(llm) == reference
        stats = llm.engine.get_stats()
        full_blocks = sum((len(p) - 1) // BS for p in PROMPTS)
        assert stats.kv_tiers.num_loaded_blocks == full_blocks
        assert sum(t.hits for t in stats.kv_tiers.tiers) == full_blocks
        # only each prompt's tail past its last whole block was computed again
        assert stats.num_computed_prompt_tokens - before == sum(
            len(p) - (len(p) - 1) // BS * BS for p in PROMPTS
        )


def test_write_back_passes_blocks_l1_evicts_to_the_host_tier(
    tiny_qwen3: Path, reference: list[list[int]]
) -> None:
    many = random_prompts([200] * 6, seed=11)  # 6 x 13 blocks through a 40-block pool: L1 evicts
    with LLM(str(tiny_qwen3), num_blocks=64, block_size=BS) as base:
        want = _tokens(base, many)
    with LLM(
        str(tiny_qwen3), num_blocks=40, block_size=BS, host_memory_gb=0.01, write_policy="write_back"
    ) as llm:
        assert _tokens(llm, many) == want
        _settle(llm)
        assert _tier(llm, "host").writes > 0  # only what L1 evicted
        assert _tokens(llm, many) == want
        assert _tier(llm, "host").hits > 0


def test_corrupted_disk_block_is_recomputed_never_served(
    tiny_qwen3: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    path = tmp_path / "arena"
    with LLM(str(tiny_qwen3), num_blocks=64, block_size=BS, disk_path=str(path), disk_gb=0.01) as llm:
        assert _tokens(llm) == reference
        _settle(llm)
        disk = llm.engine.tiers.stack.tiers[0]
        for slot in range(disk.stats.num_blocks):  # garble every record's middle
            with open(path, "r+b") as f:
                f.seek(4096 + slot * disk.slot_bytes + 64 + 100)
                f.write(os.urandom(64))
        assert llm.engine.reset_prefix_cache()
        assert _tokens(llm) == reference
        tier = _tier(llm, "disk")
        assert tier.corrupt >= len(PROMPTS) and tier.hits == 0


def test_a_restarted_instance_finds_its_disk_tier(
    tiny_qwen3: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    kw = dict(num_blocks=64, block_size=BS, disk_path=str(tmp_path / "arena"), disk_gb=0.01)
    with LLM(str(tiny_qwen3), **kw) as llm:
        assert _tokens(llm) == reference
        _settle(llm)
    with LLM(str(tiny_qwen3), **kw) as llm:
        assert _tokens(llm) == reference
        assert _tier(llm, "disk").hits == sum((len(p) - 1) // BS for p in PROMPTS)


def test_timeout_policy_admits_a_request_whose_blocks_do_not_arrive(
    tiny_qwen3: Path, reference: list[list[int]]
) -> None:
    kw = dict(num_blocks=64, block_size=BS, host_memory_gb=0.01, prefetch_timeout_s=0.2)
    with LLM(str(tiny_qwen3), **kw) as llm:
        assert _tokens(llm) == reference
        _settle(llm)
        assert llm.engine.reset_prefix_cache()
        gate = threading.Event()
        llm.engine.tiers.worker.submit(("connect", 1), gate.wait)  # the worker is stuck behind this job
        try:
            assert _tokens(llm, PROMPTS[:1]) == reference[:1]
        finally:
            gate.set()
        stats = llm.engine.get_stats().kv_tiers
        assert stats.num_prefetch_timeouts == 1, stats


def test_instances_share_prefixes_through_the_store(
    tiny_qwen3: Path, store: StoreServer, reference: list[list[int]]
) -> None:
    kw = dict(num_blocks=64, block_size=BS, store_master=store.master)
    with LLM(str(tiny_qwen3), **kw) as first:
        assert _tokens(first) == reference
        _settle(first)
    with LLM(str(tiny_qwen3), **kw) as second:  # a fresh instance: its L1 is empty
        assert _tokens(second) == reference
        assert _tier(second, "store").hits == sum((len(p) - 1) // BS for p in PROMPTS)


def test_master_killed_mid_run_degrades_then_recovers(tiny_qwen3: Path, reference: list[list[int]]) -> None:
    server = StoreServer(restart_delay_s=3.0)
    try:
        kw = dict(num_blocks=64, block_size=BS, store_master=server.master)
        with LLM(str(tiny_qwen3), **kw) as llm:
            assert _tokens(llm, PROMPTS[:2]) == reference[:2]
            _settle(llm)
            os.kill(server.master_pid(), signal.SIGKILL)
            assert llm.engine.reset_prefix_cache()
            assert _tokens(llm, PROMPTS[:2]) == reference[:2]  # served, recomputed: the store is gone
            _settle(llm)
            down = _tier(llm, "store")
            assert not down.available and down.errors > 0
            for _ in range(600):  # the server restarts the master; the tier probes it again
                if _tier(llm, "store").available:
                    break
                assert _tokens(llm, PROMPTS[2:3]) == reference[2:3]
                _settle(llm)
                llm.engine.reset_prefix_cache()
                llm.engine.tiers.stack.tiers[0]._down_until = 0.0  # probe now instead of in 2 s
            assert _tier(llm, "store").available
            writes = _tier(llm, "store").writes
            assert llm.engine.reset_prefix_cache()
            assert _tokens(llm, PROMPTS[3:]) == reference[3:]
            _settle(llm)
            assert _tier(llm, "store").writes > writes  # stores again
            assert llm.engine.reset_prefix_cache()
            assert _tokens(llm, PROMPTS[3:]) == reference[3:]
            assert _tier(llm, "store").hits > 0
    finally:
        server.stop()


@pytest.mark.parametrize(
    "kw,why",
    [
        (dict(kv_layout="xtensor", num_blocks=256), "xtensor"),
        (dict(enable_prefix_caching=False), "enable_prefix_caching"),
    ],
)
def test_what_rules_the_tiers_out_is_named(tiny_qwen3: Path, kw: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        LLM(str(tiny_qwen3), block_size=BS, host_memory_gb=0.01, **{"num_blocks": 64, **kw})
