"""Async scheduling (``xengine/step/overlap.py``) changes nothing a client sees.

The same requests run with async scheduling off and on, in one engine each: seeded sampling with
every penalty, logprobs, min_tokens and stop tokens, ``n > 1`` forks and beam search give identical
tokens, logprobs and finish reasons. A request that ends on a stop token computes at most one extra
token (never reported); one that ends by ``max_tokens`` computes none. A step that fails on the
worker is undone and re-run with per-request isolation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM, BeamSearchParams

SETTINGS: dict[str, Any] = dict(max_model_len=256, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=1, max_tokens=24, repetition_penalty=1.4, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=2, max_tokens=20, presence_penalty=0.8, frequency_penalty=0.6),
        SamplingParams(temperature=1.0, seed=3, max_tokens=22, top_k=20, top_p=0.9, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=10, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0.8, seed=4, max_tokens=25, min_p=0.05, frequency_penalty=1.5),
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, presence_penalty=0.5),
        SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=6, max_tokens=18, logprobs=0, logprob_token_ids=[5, 9, 2]),
    ]


def _outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([3, 17, 40, 9, 70, 1, 25, 33, 12], seed=21)


def test_sampling_penalties_logprobs_and_n_are_identical(tiny_qwen3: Path, prompts) -> None:
    results = {}
    for mode in ("off", "on"):
        llm = LLM(str(tiny_qwen3), async_scheduling=mode, **SETTINGS)
        results[mode] = _outputs(llm, prompts, _params())
        # a second round in the same engine: reused blocks, generators of new requests
        results[mode] += _outputs(llm, prompts[::-1], _params())
        assert llm.engine.get_stats().async_scheduling is (mode == "on")
    assert results["on"] == results["off"]


def test_stop_tokens_from_a_first_run_end_both_modes_identically(tiny_qwen3: Path, prompts) -> None:
    """Stop on a token each greedy sequence really produces (found with async off)."""
    llm_off = LLM(str(tiny_qwen3), async_scheduling="off", **SETTINGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    firsts = llm_off.generate(prompts, greedy, use_tqdm=False)
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[o.outputs[0].token_ids[7]]
        )
        for o in firsts
    ]
    llm_on = LLM(str(tiny_qwen3), async_scheduling="on", **SETTINGS)
    assert _outputs(llm_on, prompts, params) == _outputs(llm_off, prompts, params)


def test_beam_search_is_identical(tiny_qwen3: Path, prompts) -> None:
    beam = BeamSearchParams(beam_width=4, max_tokens=8)
    results = {}
    for mode in ("off", "on"):
        llm = LLM(str(tiny_qwen3), async_scheduling=mode, **SETTINGS)
        outs = llm.beam_search(prompts[:3], beam, use_tqdm=False)
        results[mode] = [[(c.token_ids, c.score) for c in o.outputs] for o in outs]
    assert results["on"] == results["off"]


def test_at_most_one_extra_token_for_a_stopped_request(tiny_qwen3: Path, prompts) -> None:
    engine = make_engine(tiny_qwen3, async_scheduling="on", **SETTINGS)
    free_at_start = engine.kv.num_free_blocks
    sampled: dict[str, int] = {}  # seq id -> steps that sampled a token for it
    run = engine.runner.run

    def recording_run(step, prev_rows=None):
        for s in step.plan.seqs:
            if s.sample:
                sampled[s.req.seq_id] = sampled.get(s.req.seq_id, 0) + 1
        return run(step, prev_rows)

    engine.runner.run = recording_run
    off = LLM(str(tiny_qwen3), async_scheduling="off", **SETTINGS)
    stop_at = {}
    for i, p in enumerate(prompts):
        toks = off.generate(
            [p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
        )
        stop_at[f"s{i}"] = toks[0].outputs[0].token_ids[5]
        engine.add_request(
            AddRequest(
                req_id=f"s{i}",
                prompt_token_ids=p,
                params=SamplingParams(
                    temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at[f"s{i}"]]
                ),
            )
        )
        engine.add_request(
            AddRequest(
                req_id=f"m{i}",
                prompt_token_ids=p,
                params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
            )
        )
    tokens: dict[str, list[int]] = {}
    for d in run_to_completion(engine):
        tokens.setdefault(d.req_id, []).extend(d.new_token_ids)
    for i in range(len(prompts)):
        assert tokens[f"s{i}"][-1] == stop_at[f"s{i}"] and len(tokens[f"m{i}"]) == 6
        # a stop token is known only once sampled: one more step may have sampled for it (dropped);
        # max_tokens is known ahead: no step past it
        assert sampled[f"s{i}"] - len(tokens[f"s{i}"]) <= 1
        assert sampled[f"m{i}"] == 6
    assert any(sampled[f"s{i}"] > len(tokens[f"s{i}"]) for i in range(len(prompts)))  # async did run ahead
    assert_engine_idle(engine, free_at_start)
