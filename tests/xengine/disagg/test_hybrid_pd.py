"""PD transfer of hybrid models between two real engines over a real Mooncake transfer engine: the
sliding-window models (tiny Gemma 3 and MiMo-V2-Flash, window 32) send their full-attention blocks and
only the window blocks a query after them reads; the recurrent models (tiny Qwen3-Next and Nemotron-H)
send their attention blocks and one state snapshot. Greedy tokens equal one colocated engine's; the bytes moved equal the theory."""

from __future__ import annotations

import pytest

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

pytest.importorskip("mooncake.engine")

BS = 16
SETTINGS = {"block_size": BS, "num_blocks": 96, "max_model_len": 512, "seed": 0}
MAX_TOKENS = 10


def _generate(engine, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
    return [t for d in run_to_completion(engine) for t in d.new_token_ids]


def _pd(prefill, decode, req_id: str, prompt: list[int]):
    first = _generate(prefill, f"{req_id}-p", prompt, 1)
    source = prefill.kv_export(f"{req_id}-x", prompt)
    result = decode.kv_import(source, prompt, pin_id=f"{req_id}-d")
    assert prefill.kv_release(f"{req_id}-x")
    before = decode.get_stats().num_computed_prompt_tokens
    rest = _generate(decode, f"{req_id}-d", prompt + first, MAX_TOKENS - 1)
    computed = decode.get_stats().num_computed_prompt_tokens - before
    return first + rest, result, source, computed


def _full_bytes(engine, num_blocks: int) -> int:
    region = engine.kv_transfer.start().region
    return num_blocks * region.block_bytes * 2 * len(region.layer_addrs)  # K and V of each layer


@pytest.mark.parametrize("arch", ["gemma3", "mimo_v2_flash", "qwen3_next", "nemotron_h"])
def test_hybrid_pd_equals_colocated_and_moves_the_theory(make_model_dir, arch) -> None:
    model = make_model_dir(arch)
    recurrent = arch in ("qwen3_next", "nemotron_h")
    kw = dict(state_snapshot_interval=32) if recurrent else {}
    prefill = make_engine(model, **SETTINGS, **kw)
    decode = make_engine(model, **SETTINGS, **kw)
    colocated = make_engine(model, **SETTINGS, **kw)
    free_p, free_d = prefill.kv.num_free_blocks, decode.kv.num_free_blocks
    prompts = random_prompts([40, 150, 230, 20], seed=11)  # the last: no whole window / no snapshot
    for i, prompt in enumerate(prompts):
        tokens, result, source, computed = _pd(prefill, decode, f"r{i}", prompt)
        assert tokens == _generate(colocated, f"c{i}", prompt, MAX_TOKENS), f"prompt {i} differs"
        k = len(source.block_ids)
        assert result.num_blocks == k and result.num_transferred_blocks == k
        if len(prompt) < 32:  # a recurrent model has no snapshot inside it: nothing to send
            assert k == 0 or not recurrent
            continue
        assert computed == len(prompt) + 1 - k * BS  # the decode side computes only past the import
        expected = _full_bytes(decode, k)
        window = decode.kv_transfer.window
        if window is not None:  # sliding-window layers (MiMo's: pages of their own size)
            assert k == len(prompt) // BS  # every window of the prompt is still held
            first = window.window.first_needed(k * BS)
            assert source.window is not None and source.window.first == first
            assert result.num_window_blocks == k - first  # the window's blocks only, not the prompt's
            per_block = window.caches[0][0, 0].nbytes * 2 * len(window.caches)  # K and V of each layer
            assert result.num_window_bytes == (k - first) * per_block
            expected += result.num_window_bytes
        else:
            assert k * BS == (len(prompt) // 32) * 32  # the last snapshot (every 32 tokens)
            assert result.num_state_bytes == decode.get_stats().state_pool.bytes_per_slot
            expected += result.num_state_bytes
        assert result.num_bytes == expected
    assert prefill.kv_transfer.num_pins == 0 and decode.kv_transfer.num_pins == 0
    prefill.reset_prefix_cache()
    decode.reset_prefix_cache()
    assert_engine_idle(prefill, free_p)
    assert_engine_idle(decode, free_d)
