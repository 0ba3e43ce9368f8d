"""Speculative decoding on recurrent hybrids (Qwen3-Next, Nemotron-H), where HF refuses speculation: the
greedy tokens equal our own engine's without speculation. A verification step writes the state after the
last token and after each draft but the last to a draft slot of its own; after a partial accept the
sequence's state is copied from the slot of its last accepted token, after a full accept nothing moves.

Random tiny models rarely accept n-gram drafts, so besides the n-gram proposer an "oracle" proposer
drafts the reference continuation with about a third of its drafts corrupted: full accepts, partial accepts and
rejections at the first draft all happen, under prefix caching (snapshots), chunked prefill and
preemption."""

from __future__ import annotations

from typing import Any

import pytest

from tests.xengine.conftest import assert_engine_idle, random_prompts
from tests.xengine.spec.oracle import OracleProposer
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
CONFIGS: dict[str, dict[str, Any]] = {
    "prefix+chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=48),
    "noprefix+whole": dict(enable_prefix_caching=False, max_num_batched_tokens=512),
    "preempt": dict(enable_prefix_caching=True, max_num_batched_tokens=48, num_blocks=20),
}


@pytest.fixture(scope="module")
def reference(make_model_dir):
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def _get(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        if arch not in cache:
            prompts = random_prompts([3, 10, 40, 90, 130, 7], seed=17)
            prompts += [prompts[3][:70] + p for p in random_prompts([5, 30], seed=18)]  # shared prefixes
            llm = LLM(str(make_model_dir(arch)), block_size=16)
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            cache[arch] = (
                prompts,
                [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)],
            )
        return cache[arch]

    return _get


CASES = [(a, c, "oracle") for a in ("qwen3_next", "nemotron_h") for c in CONFIGS]
CASES += [(a, "prefix+chunked", "ngram") for a in ("qwen3_next", "nemotron_h")]


# the default run takes one arch per configuration (alternating) and n-gram once; the rest is ``slow``
DEFAULT = {("qwen3_next", "prefix+chunked", "oracle"), ("nemotron_h", "noprefix+whole", "oracle"),
           ("qwen3_next", "preempt", "oracle"), ("nemotron_h", "prefix+chunked", "ngram")}  # fmt: skip
PARAMS = [pytest.param(*c, id="-".join(c), marks=() if c in DEFAULT else pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize(("arch", "config", "proposer"), PARAMS)
def test_greedy_tokens_equal_the_engine_without_speculation(
    make_model_dir, reference, arch, config, proposer
) -> None:
    prompts, expected = reference(arch)
    llm = LLM(str(make_model_dir(arch)), block_size=16, speculative_config=NGRAM, **CONFIGS[config])
    drafter = llm.engine.scheduler.drafter
    if proposer == "oracle":
        drafter.proposer = OracleProposer(
            {tuple(p): e for p, e in zip(prompts, expected)}, llm.engine.vocab_size
        )
    free = llm.engine.kv.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):  # the second run meets a warm prefix cache and its snapshots (when enabled)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, want) in enumerate(zip(outputs, expected)):
            assert list(out.outputs[0].token_ids) == want, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    stats = drafter.stats
    assert stats.num_draft_tokens > 0
    if proposer == "oracle":  # every kind of outcome happened
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        assert stats.accepted_per_pos[0] < stats.num_drafts and stats.accepted_per_pos[-1] > 0, stats
    states = llm.engine.state_setup.slots
    assert states.num_free_seq_slots == states.num_seq_slots and states._drafting == {}
    assert len(states._free_draft) == states.num_draft_slots
    if "num_blocks" in CONFIGS[config]:
        assert llm.engine.get_stats().num_preemptions > 0
    if not CONFIGS[config]["enable_prefix_caching"]:
        assert_engine_idle(llm.engine, free)
