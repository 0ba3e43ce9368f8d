"""Speculative decoding on models with sliding-window layers in a KV pool of their own (Gemma 3,
MiMo-V2-Flash, window 32 on the tiny checkpoints): greedy tokens identical to HF's plain greedy on
prompts longer than the window, with the window pool releasing behind the sequence's computed tokens
(never behind a rejected draft's position) and trimming the blocks only rejected drafts reached.

The proposer drafts HF's continuation with about a third of its drafts corrupted (``oracle.py``), so
full, partial and no accepts all happen; n-gram runs once per model too."""

from __future__ import annotations

from typing import Any

import pytest

from tests.xengine.conftest import assert_engine_idle, random_prompts
from tests.xengine.spec.oracle import OracleProposer
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_TOKENS = 40  # past the window of 32 from the short prompts too
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
CONFIGS: dict[str, dict[str, Any]] = {
    "prefix+chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=48),
    "noprefix+whole": dict(enable_prefix_caching=False, max_num_batched_tokens=512),
    "xtensor": dict(
        enable_prefix_caching=True, max_num_batched_tokens=48, kv_layout="xtensor", num_blocks=1024
    ),
}
CASES = [(a, c, "oracle") for a in ("gemma3", "mimo_v2_flash") for c in CONFIGS]
CASES += [(a, "prefix+chunked", "ngram") for a in ("gemma3", "mimo_v2_flash")]


@pytest.fixture(scope="module")
def reference(hf_oracle):
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def _get(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        if arch not in cache:
            prompts = random_prompts([3, 20, 50, 90], seed=23)
            prompts += [prompts[3][:70] + p for p in random_prompts([6, 33], seed=24)]
            oracle = hf_oracle(arch)
            cache[arch] = (prompts, [oracle.greedy(p, MAX_TOKENS) for p in prompts])
        return cache[arch]

    return _get


# the default run takes one arch per configuration (alternating) and n-gram once; the rest is ``slow``
DEFAULT = {("gemma3", "prefix+chunked", "oracle"), ("mimo_v2_flash", "noprefix+whole", "oracle"),
           ("gemma3", "xtensor", "oracle"), ("mimo_v2_flash", "prefix+chunked", "ngram")}  # fmt: skip
PARAMS = [pytest.param(*c, id="-".join(c), marks=() if c in DEFAULT else pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize(("arch", "config", "proposer"), PARAMS)
def test_greedy_tokens_match_hf(make_model_dir, reference, arch, config, proposer) -> None:
    prompts, expected = reference(arch)
    kw = dict(CONFIGS[config])
    if kw.get("kv_layout") != "xtensor":
        kw["block_size"] = 16
    else:
        kw["num_blocks"] = kw["num_blocks"] // 4 - 1 if arch == "mimo_v2_flash" else kw["num_blocks"]
    llm = LLM(str(make_model_dir(arch)), speculative_config=NGRAM, **kw)
    assert llm.engine.kv.window is not None  # the window layers have a pool of their own
    drafter = llm.engine.scheduler.drafter
    if proposer == "oracle":
        drafter.proposer = OracleProposer(
            {tuple(p): e for p, e in zip(prompts, expected)}, llm.engine.vocab_size
        )
    free = llm.engine.kv.num_free_blocks
    window_free = llm.engine.kv.window.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, want) in enumerate(zip(outputs, expected)):
            assert list(out.outputs[0].token_ids) == want, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    stats = drafter.stats
    assert stats.num_draft_tokens > 0
    if proposer == "oracle":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    if not CONFIGS[config]["enable_prefix_caching"]:
        assert_engine_idle(llm.engine, free)
        assert llm.engine.kv.window.num_free_blocks == window_free
