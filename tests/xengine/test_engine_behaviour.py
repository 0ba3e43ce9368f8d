"""Engine behaviour beyond greedy parity: seeded sampling, ``n > 1`` block sharing, abort churn
leaving no leak, and the prefix cache skipping exactly the shared prompt tokens."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams
from xengine.llm import LLM
from xengine.request import RequestStatus

# ---------------------------------------------------------------------------- seeded sampling


@pytest.fixture(scope="module")
def llm(make_model_dir):
    return LLM(str(make_model_dir("qwen3")), max_num_batched_tokens=64, max_num_seqs=32)


def _sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True, **kw)


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    prompt = random_prompts([12], seed=5)[0]
    alone = _tokens(llm.generate([prompt], _sampled(1234), use_tqdm=False))
    assert _tokens(llm.generate([prompt], _sampled(1234), use_tqdm=False)) == alone
    # in a batch, at another row, next to unseeded, differently seeded, greedy and chunked prompts
    others = random_prompts([3, 150, 7, 90], seed=6)
    batch = [others[0], others[1], prompt, others[2], others[3]]
    params = [_sampled(None), _sampled(99), _sampled(1234), SamplingParams(temperature=0.0), _sampled(None)]
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert outputs[2].outputs[0].token_ids == alone[0]
    # a different seed gives a different continuation
    other_seed = _tokens(llm.generate([prompt], _sampled(1235), use_tqdm=False))
    assert other_seed != alone


def test_seeded_n_sequences_are_reproducible_and_distinct(llm):
    prompt = random_prompts([20], seed=8)[0]
    first = _tokens(llm.generate([prompt], _sampled(42, n=3), use_tqdm=False))
    filler = random_prompts([5, 70], seed=9)
    batch = llm.generate(
        [filler[0], prompt, filler[1]], [_sampled(None), _sampled(42, n=3), _sampled(3)], False
    )
    assert _tokens([batch[1]]) == first
    assert len({tuple(t) for t in first}) == 3


# ---------------------------------------------------------------------------- n > 1 shares blocks

PROMPT_LEN = 100
BLOCK_SIZE = 16


def _step_until_forked(engine, req_id: str, n: int) -> list:
    deltas = []
    for _ in range(20):
        deltas += engine.step()
        if len(engine.scheduler.groups.get(req_id, [])) == n:
            return deltas
    raise AssertionError("the request never forked")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_sequences_share_prompt_blocks(make_model_dir, prefix_caching):
    engine = make_engine(
        make_model_dir("qwen3"), block_size=BLOCK_SIZE, num_blocks=64, enable_prefix_caching=prefix_caching
    )
    free_at_start = engine.kv.num_free_blocks
    prompt = random_prompts([PROMPT_LEN], seed=11)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    engine.add_request(AddRequest(req_id="r", prompt_token_ids=prompt, params=params))
    deltas = _step_until_forked(engine, "r", 4)

    seq_ids = engine.scheduler.groups["r"]
    tables = [engine.kv.block_tables[s] for s in seq_ids]
    num_full = PROMPT_LEN // BLOCK_SIZE  # 6 full blocks; the 7th (4 tokens) is copied on write
    shared = tables[0][:num_full]
    for table in tables:
        assert table[:num_full] == shared
        assert len(table) == num_full + 1
    assert all(engine.kv.pool.ref_cnt[b] == 4 for b in shared)
    last_blocks = [t[num_full] for t in tables]
    assert len(set(last_blocks)) == 4 and all(engine.kv.pool.ref_cnt[b] == 1 for b in last_blocks)
    num_used = free_at_start - engine.kv.num_free_blocks
    assert num_used == num_full + 4  # versus 4 * 7 = 28 without sharing

    deltas += run_to_completion(engine)
    outputs = _collect(deltas)["r"]
    assert sorted(outputs) == [0, 1, 2, 3]
    assert all(len(t) == 8 for t in outputs.values())
    assert len({tuple(t) for t in outputs.values()}) == 4
    assert_engine_idle(engine, free_at_start)


@pytest.mark.parametrize("layout", ["paged", "xtensor"])
def test_n_greedy_sequences_equal_the_greedy_output(make_model_dir, hf_oracle, layout):
    engine = make_engine(make_model_dir("qwen3"), block_size=BLOCK_SIZE, num_blocks=64, kv_layout=layout)
    free_at_start = engine.kv.num_free_blocks
    prompt = random_prompts([PROMPT_LEN], seed=12)[0]
    params = SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request(AddRequest(req_id="g", prompt_token_ids=prompt, params=params))
    outputs = _collect(run_to_completion(engine))["g"]
    expected = hf_oracle("qwen3").greedy(prompt, 10)
    assert outputs == {i: expected for i in range(4)}
    assert_engine_idle(engine, free_at_start)


@pytest.mark.parametrize("layout", ["paged", "xtensor"])
def test_n_sequences_survive_preemption(make_model_dir, layout):
    """Seeded n=3 requests in a 30-block pool (preempted, forks recomputed) sample exactly what they
    sample in a roomy pool (of the other layout too); greedy n=4 sequences all equal the greedy output."""
    model_dir = str(make_model_dir("qwen3"))
    roomy = LLM(model_dir, max_num_batched_tokens=64, block_size=16, num_blocks=1024, kv_layout="paged")
    tight = LLM(model_dir, max_num_batched_tokens=64, block_size=16, num_blocks=30, kv_layout=layout)
    prompts = random_prompts([100, 150, 30, 200, 5, 120], seed=13)
    params = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(6)]
    expected = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert tight.engine.get_stats().num_preemptions > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    single = _tokens(roomy.generate(prompts, greedy, use_tqdm=False))
    fours = tight.generate(
        prompts, SamplingParams(n=4, temperature=0.0, max_tokens=20, ignore_eos=True), False
    )
    assert [[c.token_ids for c in o.outputs] for o in fours] == [[t] * 4 for t in single]
    assert tight.engine.kv.num_free_blocks == 30 and tight.engine.scheduler.groups == {}


def test_online_requests_preempt_offline_ones(make_model_dir, hf_oracle):
    engine = make_engine(make_model_dir("qwen3"), num_blocks=24, max_num_batched_tokens=64, max_num_seqs=4)
    prompts = random_prompts([100, 150, 30, 90, 5, 120, 60, 7], seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    deltas = []
    for i in range(4):
        engine.add_request(
            AddRequest(req_id=f"off{i}", prompt_token_ids=prompts[i], params=params, priority="offline")
        )
    for _ in range(6):
        deltas += engine.step()
    for i in range(4, 8):
        engine.add_request(AddRequest(req_id=f"on{i}", prompt_token_ids=prompts[i], params=params))
    deltas += run_to_completion(engine)
    finish_order = [d.req_id for d in deltas if d.finish_reason is not None]
    assert finish_order[:4] == ["on4", "on5", "on6", "on7"]
    assert engine.get_stats().num_preemptions > 0
    tokens = _collect(deltas)
    oracle = hf_oracle("qwen3")
    for i, p in enumerate(prompts):
        assert tokens[f"off{i}" if i < 4 else f"on{i}"][0] == oracle.greedy(p, 12)
    assert_engine_idle(engine, 24)


def _collect(deltas) -> dict[str, dict[int, list[int]]]:
    """req_id -> index -> tokens, asserting each sequence finishes exactly once."""
    tokens: dict[str, dict[int, list[int]]] = {}
    finished: Counter = Counter()
    for d in deltas:
        assert (d.req_id, d.index) not in finished, "delta after the sequence finished"
        tokens.setdefault(d.req_id, {}).setdefault(d.index, []).extend(d.new_token_ids)
        if d.finish_reason is not None:
            finished[(d.req_id, d.index)] += 1
    return tokens


# ---------------------------------------------------------------------------- abort churn


@pytest.mark.parametrize(
    ("layout", "async_scheduling", "num_requests"),
    [
        ("paged", "off", 10_000),
        ("paged", "on", 10_000),
        ("xtensor", "off", 3_000),  # xTensor's 16-token blocks make 4x longer requests: a shorter run by
        ("xtensor", "on", 3_000),  # default, the full 10k under -m slow
        pytest.param("xtensor", "off", 10_000, marks=pytest.mark.slow),
        pytest.param("xtensor", "on", 10_000, marks=pytest.mark.slow),
    ],
)
def test_ten_thousand_requests_with_aborts_leak_nothing(
    make_model_dir, layout, async_scheduling, num_requests
):
    """10k short requests (3k with xTensor by default), a random 20% aborted while waiting or running:
    the pool, the scheduler and the runner (and the xTensor pages and slots) end exactly where they started. Small blocks
    (4 tokens; 16 with xTensor, whose page must fill a 4 KiB page) and a small id range make prompts
    share cached blocks, so aborts also race the prefix cache."""
    block_size = 16 if layout == "xtensor" else 4
    engine = make_engine(
        make_model_dir("qwen3"),
        block_size=block_size,
        num_blocks=1600 // block_size,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        kv_layout=layout,
        async_scheduling=async_scheduling,
    )
    free_at_start = engine.kv.num_free_blocks
    rng = random.Random(0)
    wave = 1_000
    abort_at: dict[int, list[str]] = {}  # step -> requests to abort before it
    abort_when_running: set[str] = set()  # abort as soon as seen running
    aborted_in: Counter = Counter()
    finish: dict[str, str] = {}
    step = 0
    next_id = 0

    def abort(req_id: str) -> None:
        req = engine.scheduler.seqs.get(req_id)
        aborted_in[req.status if req is not None else RequestStatus.FINISHED] += 1
        engine.abort_requests([req_id])

    while next_id < num_requests or engine.has_unfinished_requests():
        if next_id < num_requests and step % 8 == 0:
            for _ in range(wave):
                req_id = f"q{next_id}"
                next_id += 1
                engine.add_request(_short_request(rng, req_id, 2 * block_size))
                if rng.random() < 0.1:
                    abort_at.setdefault(step + rng.choice([0, 1, 2, 3, 5, 8, 13]), []).append(req_id)
                elif rng.random() < 0.1 / 0.9:
                    abort_when_running.add(req_id)
        for req_id in abort_at.pop(step, []):
            abort(req_id)
        for req_id in list(abort_when_running):
            req = engine.scheduler.seqs.get(req_id)
            if req is None or req.status == RequestStatus.RUNNING:
                abort_when_running.discard(req_id)
                abort(req_id)
        engine.abort_requests(["never-added"])  # unknown ids are ignored
        for d in engine.step():
            if d.finish_reason is not None:
                assert d.req_id not in finish
                finish[d.req_id] = d.finish_reason
        step += 1
        assert step < 5_000
    assert len(finish) == num_requests
    reasons = Counter(finish.values())
    assert reasons["abort"] == aborted_in[RequestStatus.WAITING] + aborted_in[RequestStatus.RUNNING]
    assert aborted_in[RequestStatus.WAITING] > 100 and aborted_in[RequestStatus.RUNNING] > 100
    assert 0.15 * num_requests < sum(aborted_in.values()) < 0.25 * num_requests
    assert engine.get_stats().prefix_cache_hits > 0
    assert_engine_idle(engine, free_at_start)


def _short_request(rng: random.Random, req_id: str, max_prompt_len: int = 8) -> AddRequest:
    prompt = [rng.randrange(3, 40) for _ in range(rng.randint(1, max_prompt_len))]
    if rng.random() < 0.3:  # a shared head whole blocks of which the prefix cache finds
        prompt = list(range(3, 3 + max_prompt_len)) + prompt
    greedy = rng.random() < 0.5
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0,
        seed=rng.randrange(1000) if rng.random() < 0.3 else None,
        max_tokens=rng.randint(1, 4),
        stop_token_ids=[rng.randrange(3, 2048)],
    )
    return AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params)


def test_abort_n_request_before_fork_leaves_nothing(make_model_dir):
    engine = make_engine(make_model_dir("qwen3"), num_blocks=64)
    free_at_start = engine.kv.num_free_blocks
    params = SamplingParams(n=3, max_tokens=4)
    engine.add_request(AddRequest(req_id="a", prompt_token_ids=[5, 6, 7], params=params))
    engine.abort_requests(["a"])
    run_to_completion(engine)
    assert_engine_idle(engine, free_at_start)
    # the id is free again
    engine.add_request(AddRequest(req_id="a", prompt_token_ids=[5, 6, 7], params=params))
    assert sorted(_collect(run_to_completion(engine))["a"]) == [0, 1, 2]


# ---------------------------------------------------------------------------- prefix cache

SHARED = 192  # 12 full blocks of 16


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_skips_exactly_the_shared_blocks(make_model_dir, hf_oracle, prefix_caching):
    llm = LLM(
        str(make_model_dir("qwen3")), block_size=16, num_blocks=128, enable_prefix_caching=prefix_caching
    )
    prompt_a = random_prompts([256], seed=21)[0]
    tail = random_prompts([70], seed=22)[0]
    if tail[0] == prompt_a[SHARED]:
        tail[0] += 1
    prompt_b = prompt_a[:SHARED] + tail
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def computed_for(prompt):
        before = llm.engine.get_stats().num_computed_prompt_tokens
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return llm.engine.get_stats().num_computed_prompt_tokens - before, out

    num_a, out_a = computed_for(prompt_a)
    num_b, out_b = computed_for(prompt_b)
    num_again, out_again = computed_for(prompt_a)  # the whole prompt is cached but its last block
    assert num_a == len(prompt_a) and out_a.num_cached_tokens == 0
    if prefix_caching:
        assert (num_b, out_b.num_cached_tokens) == (len(prompt_b) - SHARED, SHARED)
        assert (num_again, out_again.num_cached_tokens) == (16, 240)
    else:
        assert (num_b, out_b.num_cached_tokens) == (len(prompt_b), 0)
        assert (num_again, out_again.num_cached_tokens) == (len(prompt_a), 0)
    oracle = hf_oracle("qwen3")
    assert out_b.outputs[0].token_ids == oracle.greedy(prompt_b, 8)
    assert out_again.outputs[0].token_ids == out_a.outputs[0].token_ids == oracle.greedy(prompt_a, 8)
