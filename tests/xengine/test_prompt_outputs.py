"""Prompt-side outputs of the engine against HF on the same weights: prompt logprobs (chunked prefill,
async scheduling, prefix cache, ``n > 1``, preemption, sliced LM-head calls), prefill-only requests
(``max_tokens=0``) and last-token embeddings."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.xengine.conftest import HFOracle, random_prompts
from xengine.api.messages import AddRequest, PoolingParams, SamplingParams
from xengine.llm import LLM
from xengine.runner import prompt_outputs

TOL = 1e-4
K = 3
ENGINE = dict(
    max_model_len=256, block_size=16, num_blocks=128, max_num_batched_tokens=32, device="cpu", num_threads=1
)


@pytest.fixture(scope="module")
def hf(hf_oracle: Callable[[str], HFOracle]) -> HFOracle:
    return hf_oracle("qwen3")  # the tiny_qwen3 checkpoint


def hf_logprobs(hf: HFOracle, ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row i is the distribution of token i + 1 given tokens <= i."""
    return hf.logits(ids)[:-1].log_softmax(-1)


def check_prompt_logprobs(out: Any, hf_lp: torch.Tensor, k: int = K) -> None:
    """``RequestOutput.prompt_logprobs`` equals HF's: per position ``{token: logprob}`` of the prompt
    token and the top-k tokens (k or k + 1 entries), every value HF's within ``TOL``."""
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, ref = out.prompt_logprobs[i], hf_lp[i - 1]
        assert ids[i] in entry and len(entry) in (k, k + 1), f"position {i}: {entry}"
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(ref[token_id].item(), abs=TOL), f"position {i}, token {token_id}"
        if k:
            top = sorted(entry.values())[-k:]
            assert top == pytest.approx(sorted(ref.topk(k).values.tolist()), abs=TOL), f"top-{k} at {i}"


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def llm(request: pytest.FixtureRequest, tiny_qwen3: Path) -> Iterator[LLM]:
    engine = LLM(str(tiny_qwen3), async_scheduling=request.param, **ENGINE)
    yield engine
    del engine
    gc.collect()


def test_prompt_logprobs_chunked_match_hf(llm: LLM, hf: HFOracle, monkeypatch: pytest.MonkeyPatch) -> None:
    """100-token prompts over 32-token chunks, the LM head fed 7 rows at a time; with generation too."""
    monkeypatch.setattr(prompt_outputs, "ROWS_PER_SLICE", 7)
    prompts = random_prompts([100, 45], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(out, hf_logprobs(hf, prompt))
        assert out.outputs[0].token_ids == hf.greedy(prompt, 4)


def test_prompt_logprobs_with_a_cached_prefix(llm: LLM, hf: HFOracle) -> None:
    """A prompt already in the prefix cache still gets every position's logprob (it is recomputed: a
    cached block has no hidden states), and its blocks serve the next plain request."""
    prompt = random_prompts([90], seed=2)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], plain, use_tqdm=False)
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 80  # cached: 5 blocks
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=K), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_prompt_logprobs(out, hf_logprobs(hf, prompt))
    llm.engine.reset_prefix_cache()
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens == 80  # left by it
    check_prompt_logprobs(out, hf_logprobs(hf, prompt), k=0)


def test_prefill_only_and_n(llm: LLM, hf: HFOracle) -> None:
    """``max_tokens=0``: the prompt is computed, nothing sampled, every sequence ends "length"; the
    prompt's logprobs come once per request also with ``n > 1`` (with and without generation)."""
    prompt = random_prompts([40], seed=3)[0]
    ref = hf_logprobs(hf, prompt)
    for max_tokens in (0, 3):
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=max_tokens, prompt_logprobs=2)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [len(o.token_ids) for o in out.outputs] == [max_tokens] * 3
        assert {o.finish_reason for o in out.outputs} == {"length"}
        check_prompt_logprobs(out, ref, k=2)


def test_prompt_logprobs_under_preemption(tiny_qwen3: Path, hf: HFOracle) -> None:
    """Few KV blocks for many prompts: sequences are preempted and recomputed (prompt logprobs of the
    recomputed positions are not repeated), with async scheduling on."""
    engine = LLM(str(tiny_qwen3), async_scheduling="on", **{**ENGINE, "num_blocks": 24})
    prompts = random_prompts([120, 100, 90, 110, 80, 70], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=1, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(out, hf_logprobs(hf, prompt), k=1)


@torch.no_grad()
def hf_embedding(model_dir: Path, ids: list[int], dims: int | None = None) -> torch.Tensor:
    from transformers import AutoModel

    base = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    last = base(torch.tensor([ids])).last_hidden_state[0, -1]  # after the final norm
    return torch.nn.functional.normalize(last[:dims] if dims else last, dim=0)


def test_embeddings_match_hf(llm: LLM, tiny_qwen3: Path) -> None:
    """Last-token pooling, L2-normalised, with a chunked prompt, a prefix-cache hit and Matryoshka
    truncation."""
    prompts = random_prompts([70, 5], seed=6)
    outs = llm.embed(prompts, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert torch.allclose(torch.tensor(out.embedding), hf_embedding(tiny_qwen3, prompt), atol=1e-5)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    again = llm.embed(prompts[:1], dimensions=16, use_tqdm=False)[0]
    assert again.num_cached_tokens == 64  # the last token is always computed: hits are kept
    assert torch.allclose(torch.tensor(again.embedding), hf_embedding(tiny_qwen3, prompts[0], 16), atol=1e-5)


@pytest.mark.parametrize(
    "params,pooling,match",
    [
        (SamplingParams(prompt_logprobs=21), None, r"'prompt_logprobs'.*\[0, 20\]"),
        (SamplingParams(prompt_logprobs=-1), None, r"'prompt_logprobs'.*\[0, 20\]"),
        (SamplingParams(max_tokens=-1), None, r"'max_tokens'.*non-negative"),
        (SamplingParams(max_tokens=1), PoolingParams(), r"'max_tokens'.*max_tokens=0"),
        (SamplingParams(max_tokens=0), PoolingParams(dimensions=100_000), r"'dimensions'.*hidden size"),
        (SamplingParams(max_tokens=0, use_beam_search=True, beam_width=2), None, r"'max_tokens'.*beam"),
        (SamplingParams(prompt_logprobs=1, use_beam_search=True, beam_width=2), None, r"'prompt_logprobs'"),
    ],
)
def test_bad_prompt_output_requests(llm: LLM, params: SamplingParams, pooling: Any, match: str) -> None:
    req = AddRequest(req_id="bad", prompt_token_ids=[5, 6, 7], params=params, pooling=pooling)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(req)
    assert not llm.engine.has_unfinished_requests()
