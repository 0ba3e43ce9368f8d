"""MiMo-V2-Flash (sliding-window layers with twice the KV heads and attention sinks, query/key heads
wider than value heads, per-kind RoPE, a dense layer then MoE) through the whole engine, against HF.

Prompts several windows long, prefill chunks shorter and longer than the window, forced preemption, a
warm prefix cache, seeded ``n > 1`` with async scheduling on and off; the two KV pools' page sizes;
``cache.hybrid_kv off`` refused (one pool cannot hold two head counts); and checks that the window and
the sinks really change the output (so the parity above would catch either applied wrongly).
"""

from __future__ import annotations

import json

import pytest

from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

WINDOW = 32  # of the tiny mimo_v2_flash checkpoint (make_tiny)
MAX_TOKENS = 12
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def mimo(make_model_dir):
    return make_model_dir("mimo_v2_flash")


@pytest.fixture(scope="module")
def config(mimo):
    return json.loads((mimo / "config.json").read_text())


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3, 40, 100, 150], seed=5)


@pytest.fixture(scope="module")
def expected(mimo, hf_oracle, prompts):
    oracle = hf_oracle("mimo_v2_flash")
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_checkpoint_has_the_mimo_shape(config) -> None:
    assert config["sliding_window"] == WINDOW
    assert config["layer_types"].count("full_attention") == 1
    assert config["layer_types"].count("sliding_attention") == 4
    assert config["mlp_layer_types"] == ["dense"] + ["sparse"] * 4
    assert config["v_head_dim"] < config["head_dim"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=16),  # chunks shorter than the window
        dict(max_num_batched_tokens=48),  # longer than the window, not a multiple of it
        dict(max_num_batched_tokens=64, num_blocks=16),  # running sequences preempted
    ],
    ids=["chunk16", "chunk48", "preempt"],
)
def test_greedy_matches_hf_past_the_window(mimo, prompts, expected, kw) -> None:
    llm = LLM(str(mimo), block_size=BLOCK_SIZE, max_num_seqs=8, enable_prefix_caching=True, **kw)
    for run in range(2):  # the second meets a warm prefix cache
        outs = llm.generate(prompts, _greedy(), use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.outputs[0].token_ids == ref, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0
    if "num_blocks" in kw:
        assert stats.num_preemptions > 0


def test_seeded_n_is_the_same_with_async_on_and_off(mimo, prompts) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=11, max_tokens=10, ignore_eos=True)
    runs = []
    for kw in (dict(async_scheduling="off"), dict(async_scheduling="on", max_num_batched_tokens=16)):
        llm = LLM(str(mimo), block_size=BLOCK_SIZE, max_num_seqs=8, **kw)
        outs = llm.generate(prompts[2:], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
    assert runs[0] == runs[1]
    assert any(len({tuple(t) for t in seqs}) > 1 for seqs in runs[0])  # the n samples differ


def test_each_pool_has_its_own_page_size(mimo, config) -> None:
    """Window-pool blocks hold twice the KV heads of full-pool blocks: bytes per block as the theory
    says (2 x layers of the kind x block size x KV heads x head dim x 4 bytes) and as allocated."""
    llm = LLM(str(mimo), block_size=BLOCK_SIZE, num_blocks=40)
    kv = llm.engine.kv_setup
    heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    types = config["layer_types"]
    n_full, n_window = types.count("full_attention"), types.count("sliding_attention")
    assert kv.spec.bytes_per_block == 2 * n_full * BLOCK_SIZE * heads * head_dim * 4
    assert kv.window_spec.bytes_per_block == 2 * n_window * BLOCK_SIZE * 2 * heads * head_dim * 4
    assert kv.window_spec.bytes_per_block // n_window == 2 * kv.spec.bytes_per_block // n_full
    for layer, cache in enumerate(kv.kv_caches):
        window = types[layer] == "sliding_attention"
        assert cache.shape[-2:] == ((2 if window else 1) * heads, head_dim)
        spec = kv.window_spec if window else kv.spec
        assert cache.nbytes * spec.num_layers == cache.shape[1] * spec.bytes_per_block


def test_one_pool_for_every_layer_is_refused(mimo) -> None:
    with pytest.raises(
        ValueError, match="needs the sliding-window pool of its own .* which cache.hybrid_kv off rules out"
    ):
        LLM(str(mimo), block_size=BLOCK_SIZE, hybrid_kv="off")


def test_xtensor_keeps_both_pools_with_their_own_page_sizes(mimo, prompts, expected) -> None:
    """Under xTensor each pool is a layout of its own; the block size fits both page sizes."""
    llm = LLM(
        str(mimo), kv_layout="xtensor", num_blocks=256, async_scheduling="on", max_num_batched_tokens=16
    )
    kv = llm.engine.kv_setup
    assert kv.layout_name == "xtensor" and kv.window_layout is not None and llm.engine.kv.window is not None
    for run in range(2):  # the second through the prefix cache
        outs = llm.generate(prompts, _greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"run {run}"
    stats = llm.engine.get_stats()
    assert (
        stats.prefix_cache_hits > 0
        and stats.window_pool.num_free_blocks == stats.window_pool.num_total_blocks
    )


def test_the_window_changes_the_output(make_config_variant, prompts, expected) -> None:
    """The same weights with a window longer than every sequence: long prompts give other tokens."""
    wide = make_config_variant("wide-window", {"sliding_window": 256}, arch="mimo_v2_flash")
    llm = LLM(str(wide), block_size=BLOCK_SIZE, max_num_seqs=8)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    differs = [out.outputs[0].token_ids != ref for out, ref in zip(outs, expected)]
    assert not differs[0]  # 3 tokens: inside the window either way
    assert all(differs[2:])  # 100 and 150 tokens: several windows long


def test_the_sinks_change_the_output(mimo, prompts, expected) -> None:
    """Sink logits at -inf (no sink): other tokens."""
    llm = LLM(str(mimo), block_size=BLOCK_SIZE, max_num_seqs=8)
    for layer in llm.engine.model.model.layers:
        if layer.self_attn.sinks is not None:
            layer.self_attn.sinks.data.fill_(float("-inf"))
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert all(out.outputs[0].token_ids != ref for out, ref in zip(outs[1:], expected[1:]))


def test_prefix_hit_computes_only_the_uncached_tail(mimo, hf_oracle) -> None:
    """A follow-up prompt resumes after every whole block of the first (their windows are held)."""
    llm = LLM(str(mimo), block_size=BLOCK_SIZE, max_num_batched_tokens=64)
    base = random_prompts([150], seed=21)[0]
    follow = base + random_prompts([37], seed=22)[0]
    llm.generate([base], _greedy(), use_tqdm=False)
    before = llm.engine.get_stats().num_computed_prompt_tokens
    out = llm.generate([follow], _greedy(), use_tqdm=False)[0]
    computed = llm.engine.get_stats().num_computed_prompt_tokens - before
    assert computed == len(follow) - (len(base) // BLOCK_SIZE) * BLOCK_SIZE
    assert out.outputs[0].token_ids == hf_oracle("mimo_v2_flash").greedy(follow, MAX_TOKENS)
