"""Interrupted offline steps carry on from where they stopped (``xengine/colocation/resume.py``).

A forward hook sets the interrupt event at a chosen point of the first offline prefill step, as an
online arrival would; the test clears it after that step (what ``Interrupter.arm`` does before each
watched step). The step stops at the next eager check, pauses, and resumes on the next ``step()``:
tokens and logprobs must be bit for bit those of an engine never interrupted.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts
from xengine.api.messages import AddRequest, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
KW: dict[str, Any] = dict(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)


def _outputs(engine: Any, prompts: list[list[int]], stop_at: Any = None) -> dict[str, Any]:
    for i, p in enumerate(prompts):
        engine.add_request(
            AddRequest(req_id=f"off{i}", prompt_token_ids=p, params=PARAMS, priority="offline")
        )
    fired: list[bool] = []
    if stop_at is not None:
        event = engine.interrupter.event

        def hook(*_: Any) -> None:
            if not fired:
                fired.append(True)
                event.set()

        handle = stop_at(engine.runner.model.model).register_forward_hook(hook)
    out: dict[str, Any] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            toks, lps = out.setdefault(d.req_id, ([], []))
            toks.extend(d.new_token_ids)
            lps.extend(d.new_logprobs or [])
        engine.interrupter.event.clear()  # as ``arm`` does before the next watched step
    if stop_at is not None:
        handle.remove()
    return out


@pytest.mark.parametrize(
    "phase,stop_at",
    [
        ("layer", lambda m: m.layers[0].mlp),  # after layer 0: stops at layer 1's start
        ("mlp", lambda m: m.layers[1].self_attn),  # after layer 1's attention: before its MLP
        ("down", lambda m: m.layers[1].mlp.gate_up_proj),  # inside layer 1's MLP
    ],
)
def test_a_stopped_step_resumes_bit_for_bit(make_model_dir, phase, stop_at) -> None:
    model = make_model_dir("qwen3")
    prompts = random_prompts([150, 40], seed=31)
    want = _outputs(make_engine(model, **KW), prompts)
    engine = make_engine(model, **KW)
    seen: list[str] = []
    pause = engine.resumer.pause

    def record(plan: Any, stop: Any) -> bool:
        seen.append(stop.resume.phase if stop.resume is not None else "none")
        return pause(plan, stop)

    engine.resumer.pause = record
    got = _outputs(engine, prompts, stop_at)
    assert seen == [phase] and engine.resumer.num_resumed == 1 and engine.resumer.num_dropped == 0
    stats = engine.get_stats().colocation
    assert stats.num_paused_steps == 1 and stats.num_interrupted_tokens == 0
    assert got == want
    assert_engine_idle(engine, 64)


def test_a_paused_step_whose_request_is_aborted_is_dropped(make_model_dir) -> None:
    model = make_model_dir("qwen3")
    prompts = random_prompts([150, 40], seed=32)
    want = _outputs(make_engine(model, **KW), prompts[1:])
    engine = make_engine(model, **KW)
    for i, p in enumerate(prompts):
        engine.add_request(
            AddRequest(req_id=f"off{i}", prompt_token_ids=p, params=PARAMS, priority="offline")
        )
    engine.runner.model.model.layers[1].self_attn.register_forward_hook(
        lambda *_: engine.interrupter.event.set()
    )
    engine.step()  # stopped and paused
    assert engine.resumer.paused is not None and engine.scheduler.held
    engine.abort_requests(["off0"])
    engine.interrupter.event.clear()
    engine.runner.model.model.layers[1].self_attn._forward_hooks.clear()
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.req_id, []).extend(d.new_token_ids)
    assert engine.resumer.paused is None and engine.resumer.num_dropped == 1
    assert not engine.scheduler.held
    # the other request of the dropped step ran again from where it was: the same tokens
    assert out["off1"] == want["off0"][0]
    assert_engine_idle(engine, 64)


def test_a_paused_step_does_not_wait_forever(make_model_dir) -> None:
    """Online prefills that keep coming hold a paused step back only ``MAX_WAIT_STEPS`` steps."""
    from xengine.colocation.resume import MAX_WAIT_STEPS

    engine = make_engine(make_model_dir("qwen3"), **KW)
    engine.add_request(
        AddRequest(
            req_id="off",
            prompt_token_ids=random_prompts([150], seed=33)[0],
            params=PARAMS,
            priority="offline",
        )
    )
    hook = engine.runner.model.model.layers[1].self_attn.register_forward_hook(
        lambda *_: engine.interrupter.event.set()
    )
    engine.step()
    hook.remove()
    engine.interrupter.event.clear()
    assert engine.resumer.paused is not None
    for _ in range(MAX_WAIT_STEPS):
        assert engine.resumer.ready(online_pending=1) is None and engine.resumer.paused is not None
    assert engine.resumer.ready(online_pending=1) is None and engine.resumer.paused is None
    assert engine.resumer.num_dropped == 1 and not engine.scheduler.held
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(engine, 64)


def test_a_step_stopped_again_inside_the_resumed_mlp_resumes_bit_for_bit(make_model_dir) -> None:
    """Stopped before layer 1's MLP, then again inside that MLP while carrying on: the second point
    still carries the layer's residual stream, so the tokens are those of a run never stopped."""
    model = make_model_dir("qwen3")
    prompts = random_prompts([150, 40], seed=34)
    want = _outputs(make_engine(model, **KW), prompts)
    engine = make_engine(model, **KW)
    layer = engine.runner.model.model.layers[1]
    fired: list[str] = []

    def stop_once(name: str) -> Any:
        def hook(*_: Any) -> None:
            if name not in fired:
                fired.append(name)
                engine.interrupter.event.set()

        return hook

    layer.self_attn.register_forward_hook(stop_once("attention"))  # first forward: stops before the MLP
    layer.mlp.gate_up_proj.register_forward_hook(stop_once("gate_up"))  # first run of it: the resume
    seen: list[str] = []
    pause = engine.resumer.pause

    def record(plan: Any, stop: Any) -> bool:
        seen.append(stop.resume.phase if stop.resume is not None else "none")
        return pause(plan, stop)

    engine.resumer.pause = record
    got = _outputs(engine, prompts)
    assert seen == ["mlp", "down"] and engine.resumer.num_resumed == 1 and engine.resumer.num_dropped == 0
    assert got == want
    assert_engine_idle(engine, 64)
