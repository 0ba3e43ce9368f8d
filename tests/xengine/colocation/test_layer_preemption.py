"""Online arrivals stop offline prefill steps between layers (``xengine/colocation/``), and the
synchronous eager engine carries a stopped step on from where it stopped (``colocation/resume.py``).

The watcher here stands in for the engine process's input reading: on its first call (the
interruptible step is running on the worker thread) an online request "arrives"; the test hands it
to the engine after the step, as ``EngineProc`` does. Every token must equal HF's greedy tokens,
the interrupted step must apply nothing, and the next step must run the online prompt alone.
"""

from __future__ import annotations

import select

import pytest

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts
from xengine.api.messages import AddRequest, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class ArrivalWatch:
    """Fires ``online_arrived`` on the first watch call of an interruptible step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.fired = False
        self.calls = 0

    def __call__(self, timeout_s: float, wake_fd: int) -> None:
        self.calls += 1
        if not self.fired:
            self.fired = True
            self.engine.interrupter.online_arrived("on")
        else:
            select.select([wake_fd], [], [], timeout_s)


def _run(
    engine, offline: list[list[int]], online: list[int], arrive_at_once: bool = False
) -> tuple[dict[str, list[int]], list[list[str]]]:
    """Offline requests first; the online one arrives during the first interruptible step (or
    during the first step, whatever it is: ``arrive_at_once``)."""
    watch = ArrivalWatch(engine)
    watch.fired = arrive_at_once
    engine.interrupter.watch = watch
    for i, p in enumerate(offline):
        engine.add_request(
            AddRequest(req_id=f"off{i}", prompt_token_ids=p, params=PARAMS, priority="offline")
        )
    tokens: dict[str, list[int]] = {}
    steps: list[list[str]] = []  # per step with outputs: the requests that got tokens
    added = False
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        deltas = engine.step()
        for d in deltas:
            tokens.setdefault(d.req_id, []).extend(d.new_token_ids)
        steps.append(sorted({d.req_id for d in deltas if d.new_token_ids}))
        if watch.fired and not added:  # the engine process hands it over after the step
            added = True
            engine.interrupter.inputs_drained()
            engine.add_request(AddRequest(req_id="on", prompt_token_ids=online, params=PARAMS))
    engine.interrupter.watch = None
    return tokens, steps


@pytest.mark.parametrize(
    "arch,async_scheduling,graph_mode",
    [
        ("qwen3", "off", "eager"),
        ("qwen3", "on", "eager"),
        ("qwen3", "off", "partial"),
        ("qwen2", "off", "eager"),
        ("llama", "on", "eager"),
    ],
    ids=["qwen3-sync", "qwen3-async", "qwen3-partial-graph", "qwen2-sync", "llama-async"],
)
def test_online_arrival_interrupts_offline_prefill(
    make_model_dir, hf_oracle, arch, async_scheduling, graph_mode
):
    kw = {"graph_batch_sizes": "128"} if graph_mode == "partial" else {}
    engine = make_engine(
        make_model_dir(arch),
        num_blocks=64,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
        graph_mode=graph_mode,
        **kw,
    )
    offline = random_prompts([300, 200], seed=21)
    online = random_prompts([40], seed=22)[0]
    tokens, steps = _run(engine, offline, online)
    stats = engine.get_stats().colocation
    assert stats is not None and stats.num_interrupted_steps == 1
    if async_scheduling == "off" and graph_mode == "eager":  # kept, and carried on where it stopped
        assert stats.num_paused_steps == 1 and stats.num_interrupted_tokens == 0
        assert engine.resumer.num_resumed == 1 and engine.resumer.paused is None
    else:  # stopped at attention (compiled) or rewound (async): computed again
        assert stats.num_paused_steps == 0 and stats.num_interrupted_tokens > 0
    oracle = hf_oracle(arch)
    assert tokens["on"] == oracle.greedy(online, 6)
    for i, p in enumerate(offline):
        assert tokens[f"off{i}"] == oracle.greedy(p, 6)
    # the online prompt (40 tokens, one chunk) runs in a step of its own: its first token comes
    # alone, before any offline request's first token (the offline prompts were mid-prefill)
    first_on = next(i for i, s in enumerate(steps) if "on" in s)
    assert steps[first_on] == ["on"]
    assert not any(s for s in steps[:first_on])
    assert_engine_idle(engine, 64)


def test_step_level_mode_never_interrupts(make_model_dir, hf_oracle):
    engine = make_engine(
        make_model_dir("qwen3"),
        num_blocks=64,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        offline_preemption="step",
    )
    offline = random_prompts([300], seed=23)
    online = random_prompts([40], seed=24)[0]
    tokens, _ = _run(engine, offline, online, arrive_at_once=True)
    stats = engine.get_stats().colocation
    assert stats is not None and stats.offline_preemption == "step" and stats.num_interrupted_steps == 0
    assert tokens["on"] == hf_oracle("qwen3").greedy(online, 6)
    assert_engine_idle(engine, 64)


def test_online_steps_and_offline_decodes_are_not_interruptible(make_model_dir):
    """Only plans of offline work that prefill are interruptible."""
    engine = make_engine(make_model_dir("qwen3"), num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    s = engine.scheduler
    p = random_prompts([100, 30], seed=25)
    engine.add_request(AddRequest(req_id="off", prompt_token_ids=p[0], params=PARAMS, priority="offline"))
    plan = s.schedule()
    assert plan.interruptible  # an offline prompt chunk
    engine.add_request(AddRequest(req_id="on", prompt_token_ids=p[1], params=PARAMS))
    plan = s.schedule()  # the online prompt; no offline chunk joins it
    assert not plan.interruptible and [x.req.req_id for x in plan.seqs] == ["on"]


def test_an_eager_step_stops_inside_the_mlp(make_model_dir):
    """An arrival during a layer's gate/up projection stops the step before its down projection
    (the MLP is most of a layer: the check inside it halves the longest wait)."""
    import threading

    import torch

    from graph.forward_context import forward_context
    from graph.interrupt import StepInterrupted
    from ops.attention_metadata import build_attention_metadata

    engine = make_engine(make_model_dir("qwen3"), num_blocks=64, max_num_seqs=8)
    model, runner = engine.runner.model, engine.runner
    layer = model.model.layers[1]
    arrived, downs = threading.Event(), []
    layer.mlp.gate_up_proj.register_forward_hook(lambda *_: arrived.set())
    layer.mlp.down_proj.register_forward_hook(lambda *_: downs.append(1))
    meta = build_attention_metadata([8], [8], [[0, 1]], engine.kv.block_size)
    ids = torch.tensor(random_prompts([8], seed=26)[0])
    with torch.inference_mode(), forward_context(meta, runner.attn_caches, 8, interrupt=arrived):
        with pytest.raises(StepInterrupted) as stopped:
            model.forward_tokens(ids, torch.arange(8))
    assert stopped.value.layer == 1 and not downs
