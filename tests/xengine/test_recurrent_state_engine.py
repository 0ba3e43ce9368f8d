"""The recurrent-state pool through the whole engine, on the tiny Qwen3-Next (gated DeltaNet 3 : 1
gated attention) and Nemotron-H (Mamba2, attention, MLP and MoE blocks): snapshot-safe prefix hits compute only the uncached tail and still equal HF, hits
are shortened to the last snapshot or refused without one (never resumed from a state of another
position), forks copy state, preemption recomputes, and what the engine cannot do is refused."""

from __future__ import annotations

import pytest

from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

ARCHS = ("qwen3_next", "nemotron_h")  # gated DeltaNet + attention; Mamba2 + attention + MLP / MoE
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(make_model_dir, arch):
    return make_model_dir(arch)


@pytest.fixture(scope="module")
def oracle(hf_oracle, arch):
    return hf_oracle(arch)


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), block_size=16, **kw)


def _computed(llm: LLM) -> int:
    return llm.engine.get_stats().num_computed_prompt_tokens


def _assert_same_as_uncached(model_dir, prompt: list[int], out) -> None:
    """The hit's tokens and their logprobs equal a run without prefix caching: a state resumed from
    the wrong position shifts the logprobs even where the tiny model's greedy tokens survive it."""
    ref = _llm(model_dir, enable_prefix_caching=False).generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-3)


def test_hit_computes_only_the_tail_from_the_last_snapshot(model_dir, oracle) -> None:
    base = random_prompts([100], seed=1)[0]
    follow = base[:90] + random_prompts([3], seed=2)[0]  # shares 90 tokens: 5 whole blocks (80)
    other = random_prompts([120], seed=9)[0]
    llm = _llm(model_dir, state_snapshot_interval=32)
    llm.generate([base], GREEDY, use_tqdm=False)
    llm.generate([other], GREEDY, use_tqdm=False)  # its state is what a reused slot would hold
    before = _computed(llm)
    out = llm.generate([follow], GREEDY, use_tqdm=False)[0]
    # snapshots at 32 and 64 (96 lies past the shared part): the hit is 64 tokens, not the 80 cached
    assert out.num_cached_tokens == 64
    assert _computed(llm) - before == len(follow) - 64
    assert out.outputs[0].token_ids == oracle.greedy(follow, MAX_TOKENS)
    _assert_same_as_uncached(model_dir, follow, out)
    stats = llm.engine.get_stats().state_pool
    assert stats is not None and stats.num_snapshot_hits == 1 and stats.num_snapshots >= 3


def test_hit_without_a_snapshot_is_refused(model_dir, oracle) -> None:
    base = random_prompts([100], seed=3)[0]
    llm = _llm(model_dir, state_snapshot_interval=128)  # no snapshot inside a 100-token prompt
    llm.generate([base], GREEDY, use_tqdm=False)
    follow = base + random_prompts([8], seed=4)[0]
    out = llm.generate([follow], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # 6 blocks are cached, but no state to resume from
    assert out.outputs[0].token_ids == oracle.greedy(follow, MAX_TOKENS)


def test_follow_up_turn_hits_past_the_previous_prompt(model_dir, oracle) -> None:
    """A chat's next turn (prompt + answer + new message) resumes from a snapshot taken while the
    answer was decoded, not only from the previous prompt's: the snapshot does not land in the
    previous request's unique tail."""
    first = random_prompts([40], seed=5)[0]
    llm = _llm(model_dir, state_snapshot_interval=16)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    answer = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
    second = first + list(answer) + random_prompts([10], seed=6)[0]
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64  # 70 shared tokens (40 + 30): snapshots at 16 .. 64
    assert out.outputs[0].token_ids == oracle.greedy(second, MAX_TOKENS)
    _assert_same_as_uncached(model_dir, second, out)


def test_forks_copy_the_state(model_dir, oracle) -> None:
    """Greedy n = 3: every fork continues from a copy of the parent's state, so all three equal HF."""
    prompts = random_prompts([37, 70], seed=7)
    params = SamplingParams(temperature=0.0, n=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    for kw in (dict(), dict(async_scheduling="on", max_num_batched_tokens=16)):
        outs = _llm(model_dir, **kw).generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ref = oracle.greedy(prompt, MAX_TOKENS)
            assert [c.token_ids for c in out.outputs] == [ref] * 3, kw


def test_preemption_and_few_state_slots(model_dir, oracle) -> None:
    prompts = random_prompts([60, 75, 90, 50], seed=8)
    expected = [oracle.greedy(p, MAX_TOKENS) for p in prompts]
    llm = _llm(model_dir, num_blocks=14, max_num_batched_tokens=64, max_num_seqs=3)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.get_stats().num_preemptions > 0
    assert llm.engine.get_stats().state_pool.num_seq_slots == 3


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(graph_mode="full"), "graph_mode"),
        (dict(state_snapshot_interval=24), "state_snapshot_interval"),
    ],
)
def test_what_it_cannot_run_is_refused(model_dir, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _llm(model_dir, **kw)


def test_beam_search_equals_hf(model_dir, oracle) -> None:
    """Every beam step forks and drops sequences: each fork copies its parent's state, so sequences
    and their scores equal HF ``generate(num_beams=3)``."""
    import torch

    from xengine.llm import BeamSearchParams

    prompt = random_prompts([45], seed=10)[0]
    llm = _llm(model_dir, max_num_batched_tokens=32)
    out = llm.beam_search(
        [prompt], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    with torch.no_grad():
        ref = oracle.model.generate(
            torch.tensor([prompt]), num_beams=3, do_sample=False, num_return_sequences=3, max_new_tokens=8,
            output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    assert [o.token_ids for o in out[0].outputs] == ref.sequences[:, len(prompt) :].tolist()
    assert [o.score for o in out[0].outputs] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
    stats = llm.engine.get_stats().state_pool
    assert stats.num_free_seq_slots == stats.num_seq_slots  # every beam's slot came back
