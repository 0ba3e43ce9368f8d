"""A step whose every sampling row is its sequence's only token and asks no logprobs reports its
tokens as one ``seq_id -> token`` dict (``StepOutput.token_ids``), applied without a ``SampledToken``
per row; ``StepOutput.sampled`` is built from it when something reads it. Either way the clients get
the same deltas.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.xengine.conftest import make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams
from xengine.scheduler.plan import SampledToken, StepOutput

SETTINGS = dict(max_model_len=256, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=4)


@pytest.fixture(scope="module")
def tiny(make_model_dir) -> Path:
    return make_model_dir("qwen3")


def test_sampled_is_built_from_the_tokens_once() -> None:
    out = StepOutput(token_ids={"a": 7, "b": 9})
    assert out.sampled == {"a": [SampledToken(7)], "b": [SampledToken(9)]}
    assert out.token_ids is None  # one form holds the step's tokens: a write to ``sampled`` counts
    out.sampled["c"] = [SampledToken(1)]
    assert set(out.sampled) == {"a", "b", "c"}
    assert StepOutput().sampled == {}


def _params(i: int) -> SamplingParams:
    if i == 1:  # logprobs: the general rows
        return SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True)
    if i == 2:  # a fork: several rows of one sequence
        return SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=7, ignore_eos=True)
    if i == 3:
        return SamplingParams(temperature=0.7, seed=11, max_tokens=8, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)


def _run(tiny: Path, monkeypatch, async_scheduling: bool, token_ids: bool) -> tuple[list, list[bool]]:  # noqa: ANN001
    """Every delta of a mixed workload, and per step whether it reported its tokens as ``token_ids``
    (``token_ids=False``: each output's ``sampled`` built before the scheduler reads it)."""
    engine = make_engine(tiny, async_scheduling=async_scheduling, **SETTINGS)
    runner, fast = engine.runner, []
    run = runner.run  # the device side of a step, in both loops (async: on the overlap worker)

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = run(*args, **kwargs)
        fast.append(out.token_ids is not None)
        if not token_ids:
            out.sampled  # noqa: B018 - built: the scheduler reads the general form
        return out

    monkeypatch.setattr(runner, "run", recorded)
    deltas = []
    for i, prompt in enumerate(random_prompts([5, 17, 9, 12, 3, 8], seed=3)):  # arrivals every few steps
        engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=prompt, params=_params(i)))
        for _ in range(2):
            deltas.extend(engine.step())
    deltas.extend(run_to_completion(engine))
    monkeypatch.undo()
    return deltas, fast


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_token_steps_give_the_deltas_of_sampled_tokens(
    tiny: Path, monkeypatch, async_scheduling: bool
) -> None:
    got, fast = _run(tiny, monkeypatch, async_scheduling, token_ids=True)
    want, _ = _run(tiny, monkeypatch, async_scheduling, token_ids=False)
    assert any(fast) and not all(fast)  # both forms ran: plain batches and ones with logprobs / forks
    key = lambda d: (d.req_id, d.index)  # noqa: E731
    assert [d.new_token_ids for d in got] == [d.new_token_ids for d in want]
    assert [(key(d), d.finish_reason, d.new_logprobs) for d in got] == [
        (key(d), d.finish_reason, d.new_logprobs) for d in want
    ]
    assert len({key(d) for d in want}) == 7  # six requests, one of them n = 2
