"""Scheduler logic in isolation: synthetic sampled tokens stand in for the model's output."""

from memory.kv_cache_manager import KVCacheManager
from xengine.api.config import SchedulerConfig
from xengine.api.messages import SamplingParams
from xengine.request import Request
from xengine.scheduler.plan import SampledToken, StepOutput
from xengine.scheduler.scheduler import Scheduler

EOS = 0


def make_scheduler(
    num_blocks=64, block_size=4, budget=16, max_seqs=8, chunked=True, prefix=True, offline_budget=0, mixed=0
):
    kv = KVCacheManager(num_blocks, block_size, prefix)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        offline_max_batched_tokens=offline_budget,
        mixed_prefill_tokens=mixed,
    )
    # like the engine: one request never outgrows the whole pool
    return Scheduler(cfg, kv, max_model_len=min(256, num_blocks * block_size), eos_token_ids=[EOS])


def make_req(req_id, prompt_len, max_tokens=4, priority="online", n=1, t=0.0, first=1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    prompt = list(range(first, first + prompt_len))
    return Request(req_id, req_id, 0, prompt, params, priority=priority, arrival_time=t)


def run_step(s, token=7):
    plan = s.schedule()
    out = StepOutput()
    for seq in plan.seqs:
        if seq.sample:
            out.sampled[seq.req.seq_id] = [SampledToken(token) for _ in range(seq.num_samples)]
    s.update(plan, out)
    return plan


def test_chunked_prefill_respects_budget_and_decodes_first():
    s = make_scheduler(budget=16)
    s.add(make_req("a", 40))
    plan = run_step(s)
    assert [x.num_new_tokens for x in plan.seqs] == [16] and not plan.seqs[0].sample
    run_step(s)
    plan = run_step(s)  # 8 left: finishes the prompt and samples
    assert plan.seqs[0].num_new_tokens == 8 and plan.seqs[0].sample
    s.add(make_req("b", 30, t=1.0, first=100))
    plan = run_step(s)
    assert plan.seqs[0].req.seq_id == "a" and plan.seqs[0].num_new_tokens == 1  # decode first
    assert plan.seqs[1].num_new_tokens == 15


def test_no_chunking_waits_for_budget():
    s = make_scheduler(budget=16, chunked=False)
    s.add(make_req("a", 40))
    assert s.schedule().is_empty


def test_preemption_by_recompute_when_blocks_run_out():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    s.add(make_req("a", 11, max_tokens=12, t=0.0))
    s.add(make_req("b", 11, max_tokens=12, t=1.0, first=50))
    for _ in range(12):
        run_step(s)
    assert s.num_preemptions > 0
    while s.has_unfinished():
        run_step(s)
    assert s.kv.num_free_blocks == 6


def test_online_preempts_offline():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64, max_seqs=1)
    s.add(make_req("off", 8, max_tokens=50, priority="offline"))
    run_step(s)
    s.add(make_req("on", 8, max_tokens=2, priority="online", t=5.0, first=30))
    plan = run_step(s)
    assert [x.req.seq_id for x in plan.seqs] == ["on"]
    assert "off" in plan.preempted_seq_ids


def test_prefix_hit_skips_shared_blocks():
    s = make_scheduler(budget=64)
    s.add(make_req("a", 20, max_tokens=1))
    while s.has_unfinished():
        run_step(s)
    s.add(make_req("b", 20, max_tokens=1))
    plan = run_step(s)
    assert plan.seqs[0].num_new_tokens == 4  # 16 of 20 tokens from the cache
    assert s.prefix_hits == 16


def test_abort_frees_everything_and_n_forks_share_blocks():
    s = make_scheduler(num_blocks=32, budget=64)
    s.add(make_req("a", 10, max_tokens=8, n=3))
    run_step(s)
    seqs = [r for r in s.running if r.req_id == "a"]
    assert len(seqs) == 3
    tables = [s.kv.get_block_table(r.seq_id) for r in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full prompt blocks shared
    assert len({t[2] for t in tables}) == 3  # partial block copied on write
    s.abort(["a"])
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == 32
    assert {r.finish_reason for r in s.take_updated()} == {"abort"}


def test_offline_work_takes_at_most_its_budget():
    """``offline_max_batched_tokens`` caps the offline share of a step; online work keeps the whole
    budget, and the plan counts the tokens it carries."""
    s = make_scheduler(budget=32, offline_budget=12)
    s.add(make_req("off", 40, priority="offline"))
    plan = run_step(s)
    assert [x.num_new_tokens for x in plan.seqs] == [12] and plan.num_batched_tokens == 12
    assert plan.interruptible
    s.add(make_req("on", 40, t=1.0, first=100))
    plan = run_step(s)  # the online prompt alone (isolated), with the whole budget
    assert [(x.req.seq_id, x.num_new_tokens) for x in plan.seqs] == [("on", 32)]
    plan = run_step(s)  # online: the 8 left; offline: still at most 12
    assert [(x.req.seq_id, x.num_new_tokens) for x in plan.seqs] == [("on", 8)]
    plan = run_step(s)  # the online decode, then offline up to its cap
    assert [(x.req.seq_id, x.num_new_tokens) for x in plan.seqs] == [("on", 1), ("off", 12)]
    assert plan.num_batched_tokens == 13


def test_decode_builds_the_prefix_cache_token_list_only_when_a_block_fills():
    """A running request's blocks (prompt + output) enter the prefix cache as each one fills, no
    sooner and no later: the scheduler builds the request's token list for the cache only then (a
    per-step copy grew with the context)."""
    s = make_scheduler(block_size=4)
    req = make_req("a", 6, max_tokens=20)
    s.add(req)
    context = list(range(1, 7)) + [7] * 19  # the prompt, then the outputs fed back (run_step samples 7)
    computed, cached = [], []
    for _ in range(20):
        run_step(s)
        computed.append(req.num_computed_tokens)
        cached.append(s.kv.get_computed_prefix(context).num_tokens)
    assert not s.running
    assert computed == list(range(6, 26))
    # the computed length 6, 7, ..., 25 fills a block at 8, 12, 16, 20 and 24 (the prompt's first at once)
    assert cached == [n // 4 * 4 for n in computed]
    assert cached[-1] == 24  # all 6 blocks


def test_prompts_beside_decodes_start_one_cap_at_a_time():
    """mixed_prefill_tokens: with no decode running, prompts fill the whole budget; beside decodes a
    step takes one prompt chunk up to the cap and further prompts only whole, so prompts arriving
    together get their first tokens in successive steps."""
    s = make_scheduler(num_blocks=128, budget=64, mixed=12)
    s.add(make_req("a", 10, max_tokens=20))
    s.add(make_req("b", 10, max_tokens=20, t=0.1, first=50))
    plan = run_step(s)  # nothing decodes yet: both prompts whole in one step
    assert [(x.req.seq_id, x.num_new_tokens) for x in plan.seqs] == [("a", 10), ("b", 10)]
    for i, first in enumerate((100, 200, 300)):
        s.add(make_req(f"w{i}", 8, t=1.0 + i, first=first))
    plan = run_step(s)  # decodes of a, b; w0 whole (8 <= 12); w1 would pass the cap
    assert [(x.req.seq_id, x.num_new_tokens) for x in plan.seqs] == [("a", 1), ("b", 1), ("w0", 8)]
    plan = run_step(s)
    assert [x.req.seq_id for x in plan.seqs if x.num_new_tokens > 1] == ["w1"]
    s.add(make_req("long", 30, t=9.0, first=400))
    plan = run_step(s)  # w2 whole, then the long prompt would pass the cap: it waits
    assert [(x.req.seq_id, x.num_new_tokens) for x in plan.seqs if x.num_new_tokens > 1] == [("w2", 8)]
    plan = run_step(s)  # the step's first prompt chunk takes up to the cap
    assert [(x.req.seq_id, x.num_new_tokens) for x in plan.seqs if x.num_new_tokens > 1] == [("long", 12)]
