"""Greedy tokens of the whole engine (scheduler, KV cache, runner, sampler) identical to HF.

The oracle is HF ``transformers`` ``generate(do_sample=False)`` in float32 on the same tiny
checkpoint, one prompt at a time. Logits closeness of the model alone (max abs diff <= 1e-4
through paged attention) is covered by ``tests/xengine/models/test_model_parity.py``; here the engine
runs 16 prompts together under each scheduling configuration and every token must match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.xengine.conftest import ARCHS, random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_TOKENS = 20
BLOCK_SIZE = 16
SHARED_PREFIX_LEN = 150

# name -> LLM kwargs. Chunked prefill off needs a budget >= the longest prompt (300 tokens).
CONFIGS: dict[str, dict[str, Any]] = {
    "prefix+chunked": dict(
        enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64
    ),
    "prefix+whole": dict(
        enable_prefix_caching=True, enable_chunked_prefill=False, max_num_batched_tokens=512
    ),
    "noprefix+chunked": dict(
        enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=64
    ),
    "noprefix+whole": dict(
        enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=512
    ),
    # 40 (24) blocks of 16 tokens for 16 prompts of up to 320 tokens: running sequences get preempted
    "preempt": dict(
        enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64, num_blocks=40
    ),
    "preempt+noprefix+whole": dict(
        enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=512, num_blocks=24
    ),
}
# Engine modes: KV layout x async scheduling x graph mode. Partial graphs capture one 16-token bucket
# (decode batches here have at most 16 sequences; smaller ones are padded to it; prefill steps run eager).
MODES: dict[str, dict[str, Any]] = {
    "paged": dict(kv_layout="paged", async_scheduling="off", graph_mode="eager"),
    "paged+async": dict(kv_layout="paged", async_scheduling="on", graph_mode="eager"),
    "paged+partial": dict(
        kv_layout="paged", async_scheduling="off", graph_mode="partial", graph_batch_sizes="16"
    ),
    "paged+async+partial": dict(
        kv_layout="paged", async_scheduling="on", graph_mode="partial", graph_batch_sizes="16"
    ),
    "xtensor": dict(kv_layout="xtensor", async_scheduling="off", graph_mode="eager", num_blocks=1024),
    "xtensor+async+partial": dict(
        kv_layout="xtensor",
        async_scheduling="on",
        graph_mode="partial",
        graph_batch_sizes="16",
        num_blocks=1024,
    ),
}
# The tiny models make a run cost about a second: every arch runs every configuration in every mode.
# (xTensor maps each block of each layer's K and V: a pool of 1024 blocks, not the default 4096, keeps
# the worst case inside vm.max_map_count at this small block size.)
# MiMo-V2-Flash's tiny KV rows (one 48-wide head in its full layers) fill a 4 KiB page only with 64-token
# blocks: under xTensor it takes the block size xTensor picks
XTENSOR_PICKS_BLOCK = ("mimo_v2_flash",)
CASES = [(arch, name, mode) for arch in ARCHS for name in CONFIGS for mode in MODES]
# The hybrid models are slower per run (per-sequence scans, MoE): in the default run each of their
# configurations runs in one mode and each mode once (a different pairing per model); every other case
# is marked slow (``-m slow``).
HYBRIDS = ("qwen3_next", "nemotron_h", "mimo_v2_flash")


def _default_run(arch: str, config: str, mode: str) -> bool:
    if arch not in HYBRIDS:
        return True
    i, modes = list(CONFIGS).index(config) + HYBRIDS.index(arch), list(MODES)
    return mode == modes[i % len(modes)]


PARAMS = [
    pytest.param(a, c, m, id=f"{a}-{c}-{m}", marks=() if _default_run(a, c, m) else pytest.mark.slow)
    for a, c, m in CASES
]


def make_prompts(seed: int) -> list[list[int]]:
    """16 prompts: 6 short (1-10), 2 medium, 4 long (100-300) and 4 sharing a 150-token prefix."""
    short = random_prompts([1, 2, 3, 5, 8, 10], seed)
    medium = random_prompts([33, 64], seed + 1)
    long = random_prompts([100, 171, 240, 300], seed + 2)
    prefix = random_prompts([SHARED_PREFIX_LEN], seed + 3)[0]
    shared = random_prompts([1, 17, 40, 90], seed + 4, prefix=prefix)
    # interleave so short, long and shared prompts are scheduled together
    return [p for group in zip(short[:4], long, shared, short[2:] + medium) for p in group]


def greedy_reference(hf_oracle: Any, archs: tuple[str, ...], seed: int) -> Any:
    """``arch -> (prompts, HF's greedy tokens)`` for the parallel parity matrices, computed once per
    architecture (prompts seeded ``seed`` + the arch's index)."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def _get(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        if arch not in cache:
            prompts = make_prompts(seed=seed + archs.index(arch))
            oracle = hf_oracle(arch)
            cache[arch] = prompts, [oracle.greedy(p, MAX_TOKENS) for p in prompts]
        return cache[arch]

    return _get


def case_params(cases: list[tuple], slow_cases: list[tuple]) -> list[Any]:
    """pytest params of a parity matrix, each named by its fields; ``slow_cases`` marked slow."""
    return [pytest.param(*c, id="-".join(map(str, c))) for c in cases] + [
        pytest.param(*c, id="-".join(map(str, c)), marks=pytest.mark.slow) for c in slow_cases
    ]


@dataclass
class Reference:
    prompts: list[list[int]]
    tokens: list[list[int]]


@pytest.fixture(scope="module")
def reference(hf_oracle):
    """Per arch: the 16 prompts and HF's greedy tokens for them (ignore_eos), computed once."""
    cache: dict[str, Reference] = {}

    def _get(arch: str) -> Reference:
        if arch not in cache:
            prompts = make_prompts(seed=ARCHS.index(arch) * 10)
            oracle = hf_oracle(arch)
            cache[arch] = Reference(prompts, [oracle.greedy(p, MAX_TOKENS) for p in prompts])
        return cache[arch]

    return _get


def test_prompt_mix():
    prompts = make_prompts(0)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 16
    assert sum(n <= 10 for n in lengths) >= 4 and sum(n >= 100 for n in lengths) >= 8
    assert sum(p[:SHARED_PREFIX_LEN] == prompts[2][:SHARED_PREFIX_LEN] for p in prompts) == 4


@pytest.mark.parametrize(("arch", "config", "mode"), PARAMS)
def test_greedy_tokens_match_hf(make_model_dir, reference, arch, config, mode):
    ref = reference(arch)
    kw = {**MODES[mode], **CONFIGS[config]}
    own = arch in XTENSOR_PICKS_BLOCK and kw["kv_layout"] == "xtensor"
    if own and "num_blocks" in CONFIGS[config]:  # about the same tokens in 64-token blocks: still preempts
        kw["num_blocks"] = CONFIGS[config]["num_blocks"] // 4 - 1
    llm = LLM(str(make_model_dir(arch)), block_size=None if own else BLOCK_SIZE, max_num_seqs=16, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # twice: the second run meets a warm prefix cache (when enabled) and a reused pool
    for run in range(2):
        outputs = llm.generate(ref.prompts, params, use_tqdm=False)
        for i, (out, expected) in enumerate(zip(outputs, ref.tokens)):
            got = out.outputs[0]
            assert got.token_ids == expected, f"run {run}, prompt {i} ({len(ref.prompts[i])} tokens)"
            assert got.finish_reason == "length"
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.async_scheduling == (MODES[mode]["async_scheduling"] == "on")
    if MODES[mode]["graph_mode"] == "partial":  # the decode steps really ran through the graph
        assert stats.graph.num_replays > 0 and stats.graph.num_recompiles_after_warmup == 0
    if "num_blocks" in CONFIGS[config]:
        assert stats.num_preemptions > 0
    if CONFIGS[config]["enable_prefix_caching"]:
        assert stats.prefix_cache_hits >= len(ref.prompts) // 2 * BLOCK_SIZE
    else:
        assert stats.prefix_cache_hits == 0


def _eos_prompts(llm: LLM, num: int) -> list[list[int]]:
    """Short prompts whose greedy continuation ends in eos within MAX_TOKENS, plus as many that do not."""
    stopped, ran_out = [], []
    for seed in range(77, 82):  # a model that rarely says eos gets more candidates
        candidates = random_prompts([1 + i % 10 for i in range(400)], seed=seed)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outputs = llm.generate(candidates, params, use_tqdm=False)
        stopped += [p for p, o in zip(candidates, outputs) if o.outputs[0].finish_reason == "stop"]
        ran_out += [p for p, o in zip(candidates, outputs) if o.outputs[0].finish_reason == "length"]
        if stopped:
            break
    return stopped[:num] + ran_out[:num]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_stops_at_eos_like_hf(make_model_dir, hf_oracle, arch):
    """Without ignore_eos the engine stops where HF stops (HF eos ids from generation_config)."""
    llm = LLM(str(make_model_dir(arch)), max_num_seqs=256, max_num_batched_tokens=1024)
    prompts = _eos_prompts(llm, num=3)
    oracle = hf_oracle(arch)
    assert oracle.eos_token_ids and set(oracle.eos_token_ids) == set(llm.engine.info.eos_token_ids)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    num_eos = 0
    for prompt, out in zip(prompts, outputs):
        expected = oracle.greedy(prompt, MAX_TOKENS, ignore_eos=False)
        got = out.outputs[0]
        assert got.token_ids == expected
        if expected and expected[-1] in oracle.eos_token_ids:  # HF stopped at eos (maybe the last token)
            num_eos += 1
            assert (got.finish_reason, got.stop_reason) == ("stop", None)
        else:
            assert got.finish_reason == "length"
    assert num_eos >= 1
