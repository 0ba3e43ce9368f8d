"""Gemma 3 (sliding-window layers with one global layer in four, per-type RoPE) through the whole engine.

The parity matrix (``tests/xengine/test_engine_parity.py``) runs it in every mode and scheduling
configuration; here the cases that are about the window: prompts several windows long, prefill
chunks shorter and longer than the window, forced preemption, seeded ``n > 1``, and a check that the
window really changes the output (so the tests above would catch a window applied wrongly).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

WINDOW = 32  # of the tiny gemma3 checkpoint (make_tiny)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3(make_model_dir):
    return make_model_dir("gemma3")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3, 31, 33, 70, 150, 260], seed=5)


@pytest.fixture(scope="module")
def expected(gemma3, hf_oracle, prompts):
    oracle = hf_oracle("gemma3")
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


def test_checkpoint_is_hybrid(gemma3) -> None:
    config = json.loads((gemma3 / "config.json").read_text())
    assert config["sliding_window"] == WINDOW
    assert config["layer_types"].count("full_attention") == 1
    assert config["layer_types"].count("sliding_attention") == 3


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=16),  # chunks shorter than the window
        dict(max_num_batched_tokens=48),  # longer than the window, not a multiple of it
        dict(max_num_batched_tokens=64, num_blocks=24),  # 16-token blocks: running sequences preempted
        dict(max_num_batched_tokens=16, kv_layout="xtensor", num_blocks=512, async_scheduling="on"),
    ],
    ids=["chunk16", "chunk48", "preempt", "xtensor+async+chunk16"],
)
def test_greedy_matches_hf_past_the_window(gemma3, prompts, expected, kw) -> None:
    llm = LLM(str(gemma3), block_size=16, max_num_seqs=8, enable_prefix_caching=True, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):  # the second meets a warm prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.outputs[0].token_ids == ref, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    if "num_blocks" in kw and kw.get("kv_layout") != "xtensor":
        assert llm.engine.get_stats().num_preemptions > 0


def test_seeded_n_is_the_same_in_every_mode(gemma3, prompts) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=11, max_tokens=12, ignore_eos=True)
    runs = []
    for kw in (
        dict(kv_layout="paged", async_scheduling="off"),
        dict(kv_layout="paged", async_scheduling="on", max_num_batched_tokens=16),
        dict(kv_layout="xtensor", async_scheduling="off", num_blocks=512),
    ):
        llm = LLM(str(gemma3), block_size=16, **kw)
        outs = llm.generate(prompts[3:], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
    assert runs[0] == runs[1] == runs[2]
    assert any(len({tuple(t) for t in seqs}) > 1 for seqs in runs[0])  # the n samples differ


def test_the_window_changes_the_output(gemma3, prompts, expected) -> None:
    """Run with every layer's window switched off: long prompts must then give other tokens."""
    llm = LLM(str(gemma3), block_size=16)
    model = llm.engine.model
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    model.config = dataclasses.replace(model.config, sliding_windows=(None,) * len(model.model.layers))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    differs = [out.outputs[0].token_ids != ref for out, ref in zip(outs, expected)]
    assert not differs[0]  # 3 tokens: inside the window either way
    assert all(differs[4:])  # 150 and 260 tokens: several windows long
