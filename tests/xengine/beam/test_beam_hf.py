"""Beam search through the offline ``LLM`` API equals HF ``generate(num_beams=k)`` on the tiny checkpoint.

Sequences must match exactly and ``sequences_scores`` within 1e-4, for k in {2, 4, 8}: with HF's
defaults (length_penalty 1.0, early_stopping False), with early_stopping True and length_penalty 0.5,
and with "never" and length_penalty 2.0. A stop id taken from the greedy path makes beams finish early.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM, BeamSearchParams

MAX_NEW = 10
SETTINGS = [
    dict(length_penalty=1.0, early_stopping=False),
    dict(length_penalty=0.5, early_stopping=True),
    dict(length_penalty=2.0, early_stopping="never"),
]


@pytest.fixture(scope="module", params=["paged", "xtensor"])
def llm(tiny_qwen3: Path, request: pytest.FixtureRequest) -> LLM:
    # xTensor pages must fill 4 KiB: 16-token blocks there (4 in the paged layout)
    block_size = 16 if request.param == "xtensor" else 4
    return LLM(
        str(tiny_qwen3), num_threads=1, block_size=block_size, num_blocks=2048 // block_size, max_model_len=128,
        kv_layout=request.param,
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_model(hf_oracle: Callable[[str], Any]) -> Any:
    return hf_oracle("qwen3").model


def _hf_beams(model: Any, prompt: list[int], k: int, eos: list[int] | None, **kw: Any) -> tuple[list, list]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=k,
            do_sample=False,
            num_return_sequences=k,
            max_new_tokens=MAX_NEW,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=eos,
            pad_token_id=0,
            **kw,
        )
    seqs = []
    for row in out.sequences[:, len(prompt) :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if eos and t in eos), len(row))
        seqs.append(row[:end])  # HF pads after eos
    return seqs, out.sequences_scores.tolist()


def _check(
    llm: LLM, hf_model: Any, prompt: list[int], k: int, stop: list[int] | None, **kw: Any
) -> list[str]:
    params = BeamSearchParams(
        beam_width=k, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=stop or [], **kw
    )
    out = llm.beam_search([prompt], params, use_tqdm=False)[0].outputs
    want_seqs, want_scores = _hf_beams(hf_model, prompt, k, stop, **kw)
    assert [o.token_ids for o in out] == want_seqs
    assert [o.score for o in out] == pytest.approx(want_scores, abs=1e-4)
    assert [o.index for o in out] == list(range(k))
    assert llm.engine.kv.pool.ref_cnt == [0] * llm.engine.kv.pool.num_blocks
    return [o.finish_reason for o in out]


@pytest.mark.parametrize("k", [2, 4, 8])
def test_beam_search_equals_hf(llm: LLM, hf_model: Any, k: int) -> None:
    reasons: list[str] = []
    for prompt in random_prompts([7, 12], seed=k):
        greedy = (
            llm.generate(
                [prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False
            )[0]
            .outputs[0]
            .token_ids
        )
        for setting in SETTINGS:
            _check(llm, hf_model, prompt, k, None, **setting)  # no stop token: every beam runs to the limit
            reasons += _check(llm, hf_model, prompt, k, [greedy[3]], **setting)
    assert "stop" in reasons  # the stop id ended some returned beams early


def test_beam_search_with_model_eos_and_min_tokens(llm: LLM, hf_model: Any) -> None:
    prompt = random_prompts([9], seed=5)[0]
    eos = [int(t) for t in hf_model.generation_config.eos_token_id]  # two ids: 3k candidates kept
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, min_tokens=3)
    out = llm.beam_search(prompt, params, use_tqdm=False)[0].outputs
    want_seqs, want_scores = _hf_beams(hf_model, prompt, 4, eos, min_new_tokens=3)
    assert [o.token_ids for o in out] == want_seqs
    assert [o.score for o in out] == pytest.approx(want_scores, abs=1e-4)


def test_num_return_sequences_and_generate_entry(llm: LLM) -> None:
    prompt = random_prompts([6], seed=11)[0]
    full = llm.beam_search(
        prompt, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    sp = SamplingParams(n=2, use_beam_search=True, beam_width=4, max_tokens=6, ignore_eos=True)
    top2 = llm.generate(prompt, sp, use_tqdm=False)
    assert [o.token_ids for o in top2[0].outputs] == [o.token_ids for o in full[0].outputs[:2]]
    scores = [o.score for o in full[0].outputs]
    assert scores == sorted(scores, reverse=True)
    assert full[0].outputs[0].cumulative_logprob == pytest.approx(scores[0] * 6, abs=1e-5)
