"""KV sharing of beam search: beams share prompt and common-prefix blocks; all freed at the end;
preemption of a beam group (restart from its prompt) gives the same result."""

from __future__ import annotations

from pathlib import Path

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

BLOCK = 16


def _beam(k: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(n=k, use_beam_search=True, beam_width=k, max_tokens=max_tokens, ignore_eos=True)


def test_beams_share_blocks_and_free_them(tiny_qwen3: Path) -> None:
    engine = make_engine(tiny_qwen3, block_size=BLOCK, num_blocks=256, enable_prefix_caching=False)
    free0 = engine.kv.num_free_blocks
    prompt = random_prompts([100], seed=3)[0]
    max_tokens = 12
    single = -(-(len(prompt) + max_tokens) // BLOCK)  # blocks of one sequence: 7
    engine.add_request(AddRequest(req_id="beam", prompt_token_ids=prompt, params=_beam(8, max_tokens)))
    peak, prompt_refs, deltas = 0, 0, []
    while engine.has_unfinished_requests():
        deltas += engine.step()
        peak = max(peak, free0 - engine.kv.num_free_blocks)
        tables = list(engine.kv.block_tables.values())
        if len(tables) == 8:
            # the prompt's full blocks are one set of blocks referenced by all 8 beams
            first = tables[0][: len(prompt) // BLOCK]
            assert all(t[: len(first)] == first for t in tables)
            prompt_refs = max(prompt_refs, min(engine.kv.pool.ref_cnt[b] for b in first))
    assert prompt_refs == 8
    assert peak <= len(prompt) // BLOCK + 8 * 2  # shared prompt + at most two own blocks per beam
    assert peak < 8 * single / 2
    assert sorted(d.index for d in deltas) == list(range(8))
    assert all(len(d.new_token_ids) == max_tokens and d.score is not None for d in deltas)
    assert_engine_idle(engine, free0)


def test_abort_frees_beams(tiny_qwen3: Path) -> None:
    engine = make_engine(tiny_qwen3, block_size=BLOCK, num_blocks=128)
    free0 = engine.kv.num_free_blocks
    prompt = random_prompts([40], seed=4)[0]
    engine.add_request(AddRequest(req_id="b", prompt_token_ids=prompt, params=_beam(4, 20)))
    for _ in range(4):
        engine.step()
    engine.abort_requests(["b"])
    deltas = run_to_completion(engine)
    assert sorted((d.index, d.finish_reason) for d in deltas) == [(i, "abort") for i in range(4)]
    engine.reset_prefix_cache()
    assert_engine_idle(engine, free0)


def test_preempted_beam_group_restarts_with_same_result(tiny_qwen3: Path) -> None:
    prompts = random_prompts([60, 70, 80, 90], seed=9)

    def run(num_blocks: int) -> tuple[dict, int]:
        engine = make_engine(tiny_qwen3, block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=64)
        free0 = engine.kv.num_free_blocks
        for i, p in enumerate(prompts):
            params = _beam(4, 16) if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=16)
            engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=p, params=params))
        deltas = run_to_completion(engine)
        toks: dict = {}
        for d in deltas:
            toks.setdefault((d.req_id, d.index), []).extend(d.new_token_ids)
        num_preemptions = engine.scheduler.num_preemptions
        engine.reset_prefix_cache()
        assert_engine_idle(engine, free0)
        return toks, num_preemptions

    roomy, n0 = run(512)
    tight, n1 = run(28)
    assert n0 == 0 and n1 > 0
    assert tight == roomy
