"""PD KV transfer between two real engines over a real Mooncake transfer engine (TCP on loopback).

The prefill engine computes the prompt and its first token and exports the prompt's blocks; the
decode engine imports them into its prefix cache (transferring only what it lacks) and continues.
Its greedy tokens must equal one colocated engine's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memory.transfer import KVRegion, block_ranges
from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

pytest.importorskip("mooncake.engine")

SETTINGS = {"block_size": 16, "num_blocks": 96, "max_model_len": 512, "seed": 0}
MAX_TOKENS = 10


def _generate(engine, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
    return [t for d in run_to_completion(engine) for t in d.new_token_ids]


# (prefill layout, decode layout): each layout on both sides, and across (the paged view of xTensor
# memory is byte-for-byte the paged layout, so blocks move between them unchanged)
LAYOUTS = [("paged", "paged"), ("xtensor", "xtensor"), ("paged", "xtensor")]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["-".join(p) for p in LAYOUTS])
def engines(tiny_qwen3: Path, request: pytest.FixtureRequest):
    prefill_layout, decode_layout = request.param
    prefill = make_engine(tiny_qwen3, kv_layout=prefill_layout, **SETTINGS)
    decode = make_engine(
        tiny_qwen3,
        num_blocks=64,
        kv_layout=decode_layout,
        **{k: v for k, v in SETTINGS.items() if k != "num_blocks"},
    )
    colocated = make_engine(tiny_qwen3, kv_layout="paged", **SETTINGS)
    return prefill, decode, colocated


def _pd(prefill, decode, req_id: str, prompt: list[int]):
    first = _generate(prefill, f"{req_id}-p", prompt, 1)
    source = prefill.kv_export(f"{req_id}-x", prompt)
    result = decode.kv_import(source, prompt, pin_id=f"{req_id}-d")
    assert prefill.kv_release(f"{req_id}-x")
    rest = _generate(decode, f"{req_id}-d", prompt + first, MAX_TOKENS - 1)
    return first + rest, result


def test_pd_output_equals_colocated_and_prefix_hits_skip_transfer(engines) -> None:
    prefill, decode, colocated = engines
    free_p, free_d = prefill.kv.num_free_blocks, decode.kv.num_free_blocks
    shared = random_prompts([70], seed=1)[0]
    prompts = random_prompts([5, 40, 100, 200], seed=2) + random_prompts([30, 9], seed=3, prefix=shared)
    results = []
    for i, prompt in enumerate(prompts):
        tokens, result = _pd(prefill, decode, f"r{i}", prompt)
        assert tokens == _generate(colocated, f"c{i}", prompt, MAX_TOKENS), f"prompt {i} differs"
        assert result.num_blocks == len(prompt) // 16
        results.append(result)
    assert results[3].num_transferred_blocks == 12 and results[3].num_hit_blocks == 0
    region = decode.kv_transfer.start().region
    assert results[3].num_bytes == 12 * region.block_bytes * 2 * len(region.layer_addrs)  # K and V per layer
    # the second prompt with the shared 70-token prefix finds its 4 whole blocks on the decode side
    assert results[5].num_hit_blocks == 4 and results[5].num_transferred_blocks == len(prompts[5]) // 16 - 4
    assert decode.get_stats().num_kv_blocks_imported == sum(r.num_transferred_blocks for r in results)
    assert prefill.kv_transfer.num_pins == 0 and decode.kv_transfer.num_pins == 0
    prefill.reset_prefix_cache()
    decode.reset_prefix_cache()
    assert_engine_idle(prefill, free_p)
    assert_engine_idle(decode, free_d)


def test_import_pins_expire_and_layout_mismatch_is_refused(engines) -> None:
    prefill, decode, _ = engines
    prompt = random_prompts([48], seed=4)[0]
    _generate(prefill, "e-p", prompt, 1)
    source = prefill.kv_export("e-x", prompt)
    decode.kv_import(source, prompt, pin_id="never-sent")
    assert decode.kv_transfer.num_pins == 1
    decode.kv_transfer.pin_timeout_s = 0.0
    decode.kv_transfer._pins["never-sent"].deadline = 0.0
    decode.kv_transfer.expire()
    assert decode.kv_transfer.num_pins == 0 and all(c == 0 for c in decode.kv.pool.ref_cnt)
    bad = type(source)(**{**{f: getattr(source, f) for f in source.__struct_fields__}, "block_size": 32})
    with pytest.raises(ValueError, match="KV layouts"):
        decode.kv_import(bad, prompt, pin_id="bad")
    assert prefill.kv_release("e-x") and not prefill.kv_release("e-x")


def test_block_ranges_coalesce_consecutive_blocks() -> None:
    src = KVRegion("p:1", [1000, 9000], num_blocks=10, block_bytes=8)
    dst = KVRegion("d:2", [50000, 70000], num_blocks=4, block_bytes=8)
    s, d, n = block_ranges(src, dst, [(2, 0), (3, 1), (7, 2)])
    assert len(s) == 2 * 2 * 2  # 2 layers x (K, V) x 2 runs
    assert (s[0], d[0], n[0]) == (1000 + 2 * 8, 50000, 16)
    assert (s[1], d[1], n[1]) == (1000 + 7 * 8, 50000 + 2 * 8, 8)
    assert (s[2], d[2]) == (1000 + (10 + 2) * 8, 50000 + (4 + 0) * 8)  # V starts after num_blocks


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_queued_imports_that_fill_the_pool_do_not_deadlock_the_decode_engine(
    tiny_qwen3: Path, async_scheduling: str
) -> None:
    """Imported prompts of queued requests pin the whole pool: the first of them still needs a block
    for its last partial block and nothing runs to free one. The engine unpins the others' imports
    (their blocks stay cached) instead of spinning, and every request finishes with the colocated
    engine's greedy tokens."""
    prefill = make_engine(tiny_qwen3, **SETTINGS)
    colocated = make_engine(tiny_qwen3, **SETTINGS)
    # 3 prompts of 4 blocks fill its pool
    decode = make_engine(tiny_qwen3, **{**SETTINGS, "num_blocks": 12}, async_scheduling=async_scheduling)
    prompts = random_prompts([64, 64, 64], seed=7)
    firsts, decoded = [], {}
    for i, prompt in enumerate(prompts):
        firsts.append(_generate(prefill, f"q{i}-p", prompt, 1))
        decode.kv_import(prefill.kv_export(f"q{i}-x", prompt), prompt, pin_id=f"q{i}-d")
        assert prefill.kv_release(f"q{i}-x")
    assert decode.kv.num_free_blocks == 0 and decode.kv_transfer.num_pins == 3
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        decode.add_request(AddRequest(req_id=f"q{i}-d", prompt_token_ids=prompt + firsts[i], params=params))
    for d in run_to_completion(decode, max_steps=2000):
        decoded.setdefault(d.req_id, []).extend(d.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert firsts[i] + decoded[f"q{i}-d"] == _generate(colocated, f"c{i}", prompt, MAX_TOKENS)
    assert decode.kv_transfer.num_pins == 0
