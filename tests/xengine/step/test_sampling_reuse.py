"""Decode steps reuse the previous step's sampling rows while the batch is the same
(``xengine/runner/sampling_reuse.py``), and no request ever samples with another's parameters.

Seeded requests give the same tokens whatever else is in the batch: each request runs alone, then all
together with arrivals staggered (the batch changes, steps in between reuse), and every request's
tokens are the same both ways.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.xengine.conftest import make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

SETTINGS = dict(max_model_len=256, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=11, max_tokens=24, top_k=20, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=12, max_tokens=18, top_p=0.9, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=13, max_tokens=22, min_tokens=8, logit_bias={7: 3.0}),
    SamplingParams(temperature=1.2, seed=14, max_tokens=16, min_p=0.05, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=15, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
]


def _tokens(deltas: list, req_id: str) -> list[int]:
    return [t for d in deltas if d.req_id == req_id for t in d.new_token_ids]


@pytest.fixture(scope="module")
def tiny(make_model_dir) -> Path:
    return make_model_dir("qwen3")


def test_reused_rows_sample_each_request_with_its_own_params(tiny: Path) -> None:
    prompts = random_prompts([12, 30, 7, 21, 16, 9], seed=3)
    engine = make_engine(tiny, **SETTINGS)
    alone = []
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):
        engine.add_request(AddRequest(req_id=f"alone-{i}", prompt_token_ids=prompt, params=params))
        alone.append(_tokens(run_to_completion(engine), f"alone-{i}"))
    reused_before = engine.runner.sampling_reuse.num_reused
    deltas = []
    for i, (prompt, params) in enumerate(zip(prompts, PARAMS)):  # one arrival every few steps
        engine.add_request(AddRequest(req_id=f"mixed-{i}", prompt_token_ids=prompt, params=params))
        for _ in range(3):
            deltas.extend(engine.step())
    deltas.extend(run_to_completion(engine))
    together = [_tokens(deltas, f"mixed-{i}") for i in range(len(PARAMS))]
    assert together == alone
    assert all(len(t) >= 8 for t in together)
    assert engine.runner.sampling_reuse.num_reused > reused_before  # steps did reuse rows
