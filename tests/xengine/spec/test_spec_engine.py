"""Speculative decoding (n-gram) through the whole engine: greedy tokens identical to HF's plain greedy
under prefix caching, chunked prefill, preemption, xTensor and partial graphs; stops, ``max_tokens``,
logprobs and penalties as without speculation; seeded sampling reproducible; the KV pool back to
where it started; the setups it does not run with yet refused.

Random tiny models do not repeat themselves, so n-gram drafts are mostly rejected on them; the
"bigram" checkpoint (``benchmarks/spec_checkpoints.py``) continues prompts that hold its own continuation as they go, so
its drafts are mostly accepted: both paths of the verification run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.spec_checkpoints import make_bigram_copy
from tests.xengine.conftest import HFOracle, assert_engine_idle, make_engine, random_prompts
from tests.xengine.test_engine_parity import CONFIGS, make_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def bigram_dir(make_model_dir, tmp_path_factory) -> Path:
    return make_bigram_copy(make_model_dir("qwen3"), tmp_path_factory.mktemp("bigram-qwen3"))


@pytest.fixture(scope="module")
def oracles(make_model_dir, bigram_dir) -> dict[str, Any]:
    """Per checkpoint: its HF oracle and the parity prompts' greedy tokens, computed once."""
    cache: dict[str, Any] = {}

    def _get(name: str) -> tuple[list[list[int]], list[list[int]]]:
        if name not in cache:
            path = bigram_dir if name == "bigram" else make_model_dir(name)
            oracle = HFOracle(path)
            prompts = make_prompts(seed=5)
            if name == "bigram":  # each prompt, its continuation, the prompt again: lookup finds what follows
                prompts = [p[-40:] + oracle.greedy(p[-40:], 40) + p[-40:] for p in prompts]
            cache[name] = (prompts, [oracle.greedy(p, MAX_TOKENS) for p in prompts])
        return cache[name]

    return _get


def _dir(name: str, make_model_dir, bigram_dir) -> Path:
    return bigram_dir if name == "bigram" else make_model_dir(name)


CASES = [
    ("bigram", "prefix+chunked", "paged"),
    ("bigram", "noprefix+whole", "paged"),
    ("bigram", "preempt", "paged"),
    ("bigram", "prefix+chunked", "xtensor"),
    ("bigram", "prefix+chunked", "partial"),
    ("qwen3", "prefix+chunked", "paged"),
    ("llama", "preempt", "paged"),
]
MODES = {
    "paged": dict(kv_layout="paged", graph_mode="eager"),
    "xtensor": dict(kv_layout="xtensor", graph_mode="eager", num_blocks=1024),
    "partial": dict(kv_layout="paged", graph_mode="partial", graph_batch_sizes="16,64"),
}


@pytest.mark.parametrize(("name", "config", "mode"), CASES, ids=["-".join(c) for c in CASES])
def test_greedy_tokens_match_hf(make_model_dir, bigram_dir, oracles, name, config, mode) -> None:
    prompts, expected = oracles(name)
    kw = {**CONFIGS[config], **MODES[mode]}
    if name == "bigram" and "num_blocks" in kw and mode == "paged":  # shorter prompts: a smaller pool
        kw["num_blocks"] = 20
    llm = LLM(str(_dir(name, make_model_dir, bigram_dir)), block_size=16, max_num_seqs=16, **kw,
              speculative_config=NGRAM)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):  # the second run meets a warm prefix cache (when enabled)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, want) in enumerate(zip(outputs, expected)):
            assert list(out.outputs[0].token_ids) == want, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    stats = llm.engine.scheduler.drafter.stats
    assert stats.num_draft_tokens > 0
    if name == "bigram":  # drafts really were accepted, several per step
        assert stats.acceptance_rate > 0.5 and stats.mean_accepted_length > 2.0, stats
    if "num_blocks" in CONFIGS[config]:
        assert llm.engine.get_stats().num_preemptions > 0


def _pair(model_dir: Path, **kw: Any) -> tuple[LLM, LLM]:
    """The same checkpoint without and with speculation."""
    return LLM(str(model_dir), block_size=16, **kw), LLM(
        str(model_dir), block_size=16, speculative_config=NGRAM, **kw
    )


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    return llm.generate(prompts, params, use_tqdm=False)


def test_stops_max_tokens_logprobs_and_penalties_as_without_speculation(bigram_dir) -> None:
    plain, spec = _pair(bigram_dir)
    free = spec.engine.kv.num_free_blocks
    prompts = random_prompts([3, 9, 30, 64], seed=11)
    chains = _generate(plain, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    prompts = [p + list(c.outputs[0].token_ids) + p for p, c in zip(prompts, chains)]
    greedy = [
        list(o.outputs[0].token_ids)
        for o in _generate(plain, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    ]
    stop_at = greedy[2][17]  # a token the bigram chain reaches mid-way: spec accepts past it
    cases = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            ignore_eos=True,
            presence_penalty=0.7,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
        ),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=25),
    ]
    for params in cases:
        want = _generate(plain, prompts, params)
        got = _generate(spec, prompts, params)
        for w, g in zip(want, got):
            assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), params
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            if params.logprobs:
                assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
                for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                    assert lw.keys() == lg.keys()
                    for t in lw:
                        assert abs(lw[t] - lg[t]) < 1e-4
    assert spec.engine.scheduler.drafter.stats.num_accepted_tokens > 0
    assert_engine_idle(spec.engine, free)
    assert spec.engine.scheduler.drafter.proposer.indexes == {}  # every sequence's lookup index dropped


def test_seeded_sampling_is_reproducible_and_n_forks(bigram_dir) -> None:
    _, spec = _pair(bigram_dir)
    prompts = random_prompts([5, 20], seed=3)
    chains = _generate(spec, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    prompts = [p + list(c.outputs[0].token_ids) + p for p, c in zip(prompts, chains)]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=123, ignore_eos=True, n=2)
    first = [[list(c.token_ids) for c in o.outputs] for o in _generate(spec, prompts, params)]
    second = [[list(c.token_ids) for c in o.outputs] for o in _generate(spec, prompts, params)]
    assert first == second
    assert all(len(c) == 30 for o in first for c in o)
    assert spec.engine.scheduler.drafter.stats.num_accepted_tokens > 0


def test_setups_not_supported_yet_are_refused(make_model_dir) -> None:
    with pytest.raises(ValueError, match="vision-language"):
        make_engine(make_model_dir("qwen2_vl"), speculative_config=NGRAM)
    with pytest.raises(ValueError, match="is not a folder"):
        make_engine(
            make_model_dir("qwen3"),
            speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": "/no/such/head"},
        )


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_async_scheduling_keeps_tokens_and_drafts(bigram_dir, oracles, mode) -> None:
    """Under async scheduling a plan where a sequence may draft runs synchronously; the tokens are
    HF's and drafts are accepted."""
    prompts, expected = oracles("bigram")
    llm = LLM(str(bigram_dir), block_size=16, speculative_config=NGRAM, async_scheduling=mode)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.engine.scheduler.drafter.stats.mean_accepted_length > 2.0
    # speculation off for big batches: those steps overlap again, the tokens unchanged
    big = LLM(str(bigram_dir), block_size=16, async_scheduling=mode,
              speculative_config={**NGRAM, "disable_by_batch_size": 2})  # fmt: skip
    outputs = big.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
