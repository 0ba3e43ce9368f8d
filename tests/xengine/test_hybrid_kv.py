"""Sliding-window layers in a KV pool of their own (``cache.hybrid_kv``) through the whole engine, on
the tiny Gemma 3 (window 32, one global layer in four): HF's tokens, prefix hits that compute only
the uncached tail or are shortened when a window was evicted, bounded window use during a long
generation, more sequences in the same budget, forks, the pools' stats, and the refusals."""

from __future__ import annotations

import pytest

from tests.xengine.conftest import random_prompts
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM

WINDOW, BS = 32, 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(make_model_dir):
    return str(make_model_dir("gemma3"))


@pytest.fixture(scope="module")
def oracle(hf_oracle):
    return hf_oracle("gemma3")


def _stats(llm: LLM):
    return llm.engine.get_stats()


def test_on_by_default_for_sliding_models_and_off_when_asked(gemma3, make_model_dir) -> None:
    on = LLM(gemma3, block_size=BS)
    assert on.engine.kv.window is not None
    pool = _stats(on).window_pool
    assert pool is not None and pool.window == WINDOW and pool.num_layers == 3
    assert _stats(LLM(gemma3, block_size=BS, hybrid_kv="off")).window_pool is None
    assert _stats(LLM(str(make_model_dir("qwen3")), block_size=BS)).window_pool is None  # no window


def test_refusals_name_the_fix(gemma3) -> None:
    assert LLM(gemma3, kv_layout="xtensor", hybrid_kv="on", num_blocks=512).engine.kv.window is not None
    with pytest.raises(ValueError, match="kv_layout paged"):
        LLM(gemma3, graph_mode="full", hybrid_kv="on")
    with pytest.raises(ValueError, match="window_pool_blocks"):
        LLM(gemma3, block_size=BS, window_pool_blocks=3)


def test_prefix_hit_computes_only_the_tail_and_matches_hf(gemma3, oracle) -> None:
    llm = LLM(gemma3, block_size=BS, max_num_batched_tokens=64)
    base = random_prompts([150], seed=21)[0]
    follow = base + random_prompts([37], seed=22)[0]
    llm.generate([base], GREEDY, use_tqdm=False)
    before = _stats(llm).num_computed_prompt_tokens
    out = llm.generate([follow], GREEDY, use_tqdm=False)[0]
    computed = _stats(llm).num_computed_prompt_tokens - before
    assert computed == len(follow) - (len(base) // BS) * BS  # every whole block of base came from the cache
    assert out.outputs[0].token_ids == oracle.greedy(follow, 16)


def test_hit_shortened_when_windows_were_evicted_still_matches_hf(gemma3, oracle) -> None:
    """A small window pool: decoding another long request reuses the released window blocks of the
    first prompt, so its follow-up hits only as far as a window is still held (maybe nothing)."""
    llm = LLM(gemma3, block_size=BS, max_num_batched_tokens=64, window_pool_blocks=12, max_num_seqs=2)
    base = random_prompts([150], seed=31)[0]
    llm.generate([base], GREEDY, use_tqdm=False)
    other = random_prompts([200], seed=32)[0]
    llm.generate([other], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    follow = base + random_prompts([20], seed=33)[0]
    kv = llm.engine.kv
    full_hit = kv.prefix_cache.match(follow, (len(follow) - 1) // BS).num_blocks * BS
    safe_hit = kv.get_computed_prefix(follow).num_tokens
    assert full_hit == (len(base) // BS) * BS and safe_hit < full_hit  # shortened, not taken whole
    before = _stats(llm).num_computed_prompt_tokens
    out = llm.generate([follow], GREEDY, use_tqdm=False)[0]
    assert _stats(llm).num_computed_prompt_tokens - before == len(follow) - safe_hit
    assert out.outputs[0].token_ids == oracle.greedy(follow, 16)


def test_window_use_stays_bounded_during_a_long_generation(gemma3) -> None:
    llm = LLM(gemma3, block_size=BS, max_num_batched_tokens=64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request(
        AddRequest(req_id="long", prompt_token_ids=random_prompts([200], seed=41)[0], params=params)
    )
    peak_decode = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.scheduler.seqs.get("long")
        if seq is not None and seq.num_computed_tokens > 200:
            peak_decode = max(peak_decode, engine.kv.window.num_held("long"))
    assert 0 < peak_decode <= -(-(WINDOW - 1) // BS) + 2  # the window and a block, not 600 tokens' worth


def _peak_running(llm: LLM, prompts: list[list[int]], max_tokens: int) -> int:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(req_id=f"cap-{i}", prompt_token_ids=p, params=params))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return peak


def test_same_budget_runs_more_sequences(gemma3) -> None:
    """One layer in four keeps full-length KV, three keep a 32-token window: 512-token sequences
    take 704 layer-tokens each instead of 2048, so about 2.9 times as many fit the same budget (less
    the window blocks of one 512-token prefill chunk)."""
    prompts = random_prompts([480] * 32, seed=51)
    kw = dict(
        block_size=BS,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=512,
        kv_cache_memory_gb=8 / 1024,
    )
    hybrid = _peak_running(LLM(gemma3, hybrid_kv="on", **kw), prompts, 32)
    uniform = _peak_running(LLM(gemma3, hybrid_kv="off", **kw), prompts, 32)
    assert uniform >= 1 and hybrid >= 2.4 * uniform, (hybrid, uniform)


def test_seeded_n_and_beams_are_the_same_with_and_without_the_window_pool(gemma3) -> None:
    prompts = random_prompts([70, 140], seed=61)
    sampled = SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=40, ignore_eos=True)
    beams = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=12, ignore_eos=True)
    runs = []
    for mode in ("on", "off"):
        llm = LLM(gemma3, block_size=BS, max_num_batched_tokens=64, hybrid_kv=mode)
        out = llm.generate(prompts, sampled, use_tqdm=False)
        beam = llm.generate(prompts[:1], beams, use_tqdm=False)
        runs.append(([[c.token_ids for c in o.outputs] for o in out], [c.token_ids for c in beam[0].outputs]))
    assert runs[0] == runs[1]


def test_8bit_kv_gives_the_same_tokens_with_and_without_the_window_pool(gemma3) -> None:
    """The window pool holds int8 rows like the full one: the same arithmetic, the same tokens."""
    prompts = random_prompts([40, 130], seed=81)
    runs = []
    for mode in ("on", "off"):
        llm = LLM(gemma3, block_size=BS, max_num_batched_tokens=64, kv_cache_dtype="int8", hybrid_kv=mode)
        assert (llm.engine.kv.window is not None) == (mode == "on")
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] == runs[1]
