"""Decode-only steps (``SchedulePlan.decode_only``) take their inputs from ``DecodeInputs``: the same
tensors ``build_inputs`` gives for the same plan, on every such step of a busy engine (arrivals,
finishes, block boundaries crossed, async placeholders); plans with a prompt chunk, a fork or a beam
row never count as decode-only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.xengine.conftest import make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams
from xengine.runner.input_batch import build_inputs
from xengine.runner.model_runner import ModelRunner
from xengine.scheduler.plan import SchedulePlan

SETTINGS = dict(max_model_len=256, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=4)


@pytest.fixture(scope="module")
def tiny(make_model_dir) -> Path:
    return make_model_dir("qwen3")


def _same(a, b) -> None:  # noqa: ANN001 - two ModelInputs
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert getattr(a, name).is_contiguous(), name  # views of one flat buffer: still contiguous
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        got, want = getattr(a.meta, name), getattr(b.meta, name)
        assert got.dtype == want.dtype and torch.equal(got, want) and got.is_contiguous(), name
    for name in ("query_lens_cpu", "seq_lens_cpu", "max_query_len", "max_seq_len", "block_size", "kv_slots"):
        assert getattr(a.meta, name) == getattr(b.meta, name), name
    assert a.num_tokens == b.num_tokens


def _checked(engine, monkeypatch) -> list[SchedulePlan]:  # noqa: ANN001
    """Every prepared plan; each decode-only one's inputs compared with ``build_inputs``' (a mismatch
    is recorded in ``checked.mismatches``: the engine would take an exception for a failed step)."""
    runner: ModelRunner = engine.runner
    plans: list[SchedulePlan] = []
    build = runner.decode_inputs.build

    def checked(plan: SchedulePlan, kv_slots: list[int] | None = None):  # noqa: ANN202
        checked.calls += 1
        got = build(plan, kv_slots)
        try:
            _same(got, build_inputs(plan, runner.block_size, runner.device, kv_slots))
        except AssertionError as e:
            checked.mismatches.append(str(e))
        return got

    prepare = runner.prepare

    def recorded(plan: SchedulePlan):  # noqa: ANN202
        plans.append(plan)
        context = sum(s.end for s in plan.seqs)  # as ``token_counts`` adds it up (before the update)
        if plan.decode_only and plan.token_counts() != (context, 0):
            checked.mismatches.append(f"token_counts {plan.token_counts()} != {(context, 0)}")
        return prepare(plan)

    checked.calls, checked.mismatches = 0, []
    monkeypatch.setattr(runner.decode_inputs, "build", checked)
    monkeypatch.setattr(runner, "prepare", recorded)
    return plans


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_only_steps_build_the_general_inputs(tiny: Path, monkeypatch, async_scheduling: bool) -> None:
    engine = make_engine(tiny, async_scheduling=async_scheduling, **SETTINGS)
    plans = _checked(engine, monkeypatch)
    for i, prompt in enumerate(random_prompts([5, 17, 9, 30, 3], seed=2)):  # arrivals every few steps
        params = SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True)
        engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=prompt, params=params))
        for _ in range(3):
            engine.step()
    run_to_completion(engine)
    decode_only = [p for p in plans if p.decode_only]
    assert len(decode_only) >= 10
    assert engine.runner.decode_inputs.build.calls == len(decode_only)
    assert engine.runner.decode_inputs.build.mismatches == []
    assert any(len(p.seqs) >= 3 for p in decode_only)
    for plan in plans:  # the flag is exact: every sequence one known token past its prompt, sampled
        plain = all(s.num_new_tokens == 1 and s.sample and s.num_samples == 1 for s in plan.seqs)
        if plan.decode_only:
            assert plain


def test_forks_beams_and_prompt_chunks_are_not_decode_only(tiny: Path, monkeypatch) -> None:
    engine = make_engine(tiny, **SETTINGS)
    plans = _checked(engine, monkeypatch)
    prompt = random_prompts([10], seed=4)[0]
    engine.add_request(
        AddRequest(
            req_id="n2", prompt_token_ids=prompt, params=SamplingParams(n=2, temperature=0.9, max_tokens=5)
        )
    )
    run_to_completion(engine)
    forking = [p for p in plans if any(s.num_samples > 1 for s in p.seqs)]
    assert forking and not any(p.decode_only for p in forking)
    assert not any(p.decode_only for p in plans if any(s.num_new_tokens > 1 for s in p.seqs))
    plans.clear()
    engine.add_request(
        AddRequest(
            req_id="beam",
            prompt_token_ids=prompt,
            params=SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0.0, max_tokens=4),
        )
    )
    run_to_completion(engine)
    assert plans and not any(p.decode_only for p in plans)
    assert engine.runner.decode_inputs.build.mismatches == []
