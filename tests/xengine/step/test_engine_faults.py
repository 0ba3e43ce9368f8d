"""A failure in the model forward fails the requests it hits, not the engine.

This machine has no accelerator whose faults could be provoked, so ``inject_device_fault`` stands in
for one: it wraps the real model's ``forward`` to raise ``InjectedDeviceFault`` when a condition on
the batch holds. Everything else is the real engine (scheduler, KV pool, prefix cache, runner).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import zmq

from tests.xengine.conftest import assert_engine_idle, make_engine, random_prompts, run_to_completion
from xengine.api.messages import (
    AddRequest,
    CompletionDelta,
    EngineDead,
    SamplingParams,
    StepOutputs,
    make_encoder,
    make_output_decoder,
)
from xengine.engine import Engine
from xengine.process.engine_proc import EngineProc, connect_sockets
from xengine.step.execute import MAX_CONSECUTIVE_FAILED_STEPS, EngineBrokenError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TRIGGER_ID = 1  # a special token: never in ``random_prompts``
GOOD_PROMPTS = random_prompts([20, 33, 9], seed=11)
GUARD_S = 60.0  # bounds a hanging engine loop; not a timing assertion


class InjectedDeviceFault(RuntimeError):
    """What the stand-in for a device fault raises."""


class FaultInjector:
    """Counts the forwards it failed."""

    def __init__(self) -> None:
        self.num_faults = 0


def inject_device_fault(
    monkeypatch: pytest.MonkeyPatch, engine: Engine, when: Callable[[torch.Tensor, torch.Tensor], bool]
) -> FaultInjector:
    """Make ``engine``'s model raise ``InjectedDeviceFault`` on a forward whose ``(input_ids,
    positions)`` satisfy ``when``; other forwards run the real model."""
    injector = FaultInjector()
    real_forward = engine.model.forward_tokens

    def forward_tokens(input_ids, positions):
        if when(input_ids, positions):
            injector.num_faults += 1
            raise InjectedDeviceFault("injected device fault")
        return real_forward(input_ids, positions)

    monkeypatch.setattr(engine.model, "forward_tokens", forward_tokens)
    return injector


def add(engine: Engine, req_id: str, prompt: list[int]) -> None:
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=GREEDY))


def by_request(deltas: list[CompletionDelta]) -> dict[str, list[CompletionDelta]]:
    out: dict[str, list[CompletionDelta]] = {}
    for d in deltas:
        out.setdefault(d.req_id, []).append(d)
    return out


def tokens(deltas: list[CompletionDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def new_engine(model_dir, **kw) -> Engine:
    return make_engine(model_dir, max_model_len=256, block_size=16, num_blocks=64, **kw)


@pytest.fixture(scope="module")
def reference(tiny_qwen3) -> dict[str, list[int]]:
    """Fault-free greedy outputs of the good prompts."""
    engine = new_engine(tiny_qwen3)
    for i, prompt in enumerate(GOOD_PROMPTS):
        add(engine, f"good{i}", prompt)
    return {req_id: tokens(ds) for req_id, ds in by_request(run_to_completion(engine)).items()}


BAD_PROMPT = [TRIGGER_ID, *random_prompts([40], seed=12)[0]]  # longer than every good one
FAULTS = {
    # its prompt is in the batch: fails in its first (prefill) step, batched with the good ones
    "prefill": (lambda ids, pos: bool((ids == TRIGGER_ID).any()), 0),
    # its fourth decode step (positions past the good requests' reach): fails mid-generation
    "decode": (lambda ids, pos: bool((pos == len(BAD_PROMPT) + 3).any()), 4),
}


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_fails_only_its_request(monkeypatch, tiny_qwen3, reference, fault, async_scheduling):
    """(With async scheduling the failed step, run on the worker, is undone and re-run here.)"""
    when, num_tokens_before = FAULTS[fault]
    engine = new_engine(tiny_qwen3, async_scheduling=async_scheduling)
    free_at_start = engine.kv.num_free_blocks
    injector = inject_device_fault(monkeypatch, engine, when)
    add(engine, "good0", GOOD_PROMPTS[0])
    add(engine, "bad", BAD_PROMPT)
    add(engine, "good1", GOOD_PROMPTS[1])
    deltas = by_request(run_to_completion(engine))

    assert injector.num_faults == 2  # the batch, then the bad request alone
    bad = deltas["bad"]
    assert [d.finish_reason for d in bad] == [None] * (len(bad) - 1) + ["error"]
    assert "InjectedDeviceFault: injected device fault" in bad[-1].error
    assert len(tokens(bad)) == num_tokens_before
    for req_id in ("good0", "good1"):
        assert deltas[req_id][-1].finish_reason == "length" and deltas[req_id][-1].error is None
        assert tokens(deltas[req_id]) == reference[req_id]
    assert_engine_idle(engine, free_at_start)
    if fault == "prefill":  # KV that was never computed must not be served from the prefix cache
        assert engine.kv.get_computed_prefix(BAD_PROMPT).num_tokens == 0

    add(engine, "good2", GOOD_PROMPTS[2])  # the engine keeps serving
    after = by_request(run_to_completion(engine))
    assert tokens(after["good2"]) == reference["good2"] and after["good2"][-1].finish_reason == "length"
    assert engine.executor.num_failed_steps == 0
    assert_engine_idle(engine, free_at_start)


def test_n_and_beam_requests_fail_whole(monkeypatch, tiny_qwen3):
    engine = new_engine(tiny_qwen3)
    free_at_start = engine.kv.num_free_blocks
    inject_device_fault(monkeypatch, engine, lambda ids, pos: bool((pos == len(BAD_PROMPT) + 1).any()))
    n3 = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    beam = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=8, ignore_eos=True)
    engine.add_request(AddRequest(req_id="n3", prompt_token_ids=BAD_PROMPT, params=n3))
    engine.add_request(AddRequest(req_id="beam", prompt_token_ids=BAD_PROMPT[1:] + [5], params=beam))
    deltas = by_request(run_to_completion(engine))
    for req_id, n in (("n3", 3), ("beam", 2)):
        finished = [d for d in deltas[req_id] if d.finish_reason is not None]
        assert sorted(d.index for d in finished) == list(range(n))
        assert all(d.finish_reason == "error" and "InjectedDeviceFault" in d.error for d in finished)
    assert_engine_idle(engine, free_at_start)


def test_failing_every_step_breaks_the_engine(monkeypatch, tiny_qwen3):
    engine = new_engine(tiny_qwen3, max_num_seqs=1)  # one request per step
    inject_device_fault(monkeypatch, engine, lambda ids, pos: True)  # a dead device
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS):
        add(engine, f"r{i}", GOOD_PROMPTS[0])
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        (delta,) = engine.step()
        assert (delta.req_id, delta.finish_reason) == (f"r{i}", "error")
    with pytest.raises(EngineBrokenError, match=rf"{MAX_CONSECUTIVE_FAILED_STEPS} steps in a row failed"):
        engine.step()


def test_engine_process_reports_engine_dead_after_repeated_failures(monkeypatch, tiny_qwen3):
    """The engine loop (``EngineProc`` over real ZMQ sockets) fails single requests, then gives up."""
    engine = new_engine(tiny_qwen3, max_num_seqs=1)
    inject_device_fault(monkeypatch, engine, lambda ids, pos: True)
    ctx = zmq.Context()
    service_in, service_out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    service_in.bind("inproc://engine-input")
    service_out.bind("inproc://engine-output")
    inp, out = connect_sockets(ctx, "inproc://engine-input", "inproc://engine-output")
    proc = EngineProc(engine, inp, out, parent_pid=None)
    encoder = make_encoder()
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS):
        req = AddRequest(req_id=f"r{i}", prompt_token_ids=GOOD_PROMPTS[0], params=GREEDY)
        service_in.send(encoder.encode(req))
    exit_code: list[int] = []
    loop = threading.Thread(target=lambda: exit_code.append(proc.run()), daemon=True)
    loop.start()
    loop.join(GUARD_S)
    try:
        assert not loop.is_alive(), "the engine loop did not give up"
        decoder = make_output_decoder()
        messages = []
        while service_out.poll(0):
            messages.append(decoder.decode(service_out.recv()))
    finally:
        for sock in (service_in, service_out, inp, out):
            sock.close(linger=0)
        ctx.term()
    assert exit_code == [1]  # non-zero: a supervisor restarts the process
    errors = [d for m in messages if isinstance(m, StepOutputs) for d in m.deltas]
    assert [(d.req_id, d.finish_reason) for d in errors] == [
        (f"r{i}", "error") for i in range(MAX_CONSECUTIVE_FAILED_STEPS - 1)
    ]
    assert isinstance(messages[-1], EngineDead)
    assert "steps in a row failed for every request" in messages[-1].message


def test_a_step_past_the_position_table_fails_its_request_not_the_engine(tiny_qwen3):
    """Defence in depth: were the scheduler ever to run a sequence past ``max_model_len``, the runner
    refuses the step with a clear error instead of indexing the RoPE table out of range."""
    engine = new_engine(tiny_qwen3)
    free_at_start = engine.kv.num_free_blocks
    engine.runner.max_model_len = 24  # the runner's table ends before this request's prompt does
    add(engine, "long", GOOD_PROMPTS[1])  # 33 tokens
    add(engine, "short", GOOD_PROMPTS[2])  # 9 tokens (+ 8 output) stays within 24
    deltas = by_request(run_to_completion(engine))
    assert deltas["long"][-1].finish_reason == "error"
    assert "reaches position 32, past the 24 positions" in deltas["long"][-1].error
    assert deltas["short"][-1].finish_reason == "length" and len(tokens(deltas["short"])) == 8
    assert_engine_idle(engine, free_at_start)
