"""η = engine step time / bare model forward time over steady decode steps, per batch size.

The engine is driven directly: B requests are added, ``engine.step()`` runs until every request
is past prefill, then ``engine.last_step_timing`` is read over ``num_steps`` pure-decode steps
(each with B sequences and B tokens). Host time per request per step = (total − forward − sampler) / B
(median step); the sampler is device work, reported apart (``sample_ms``). ``host_phases_us_per_req``
says where the host time goes (``StepTiming.phases``, medians): scheduling, preparing the inputs,
applying the outputs to the requests, collecting the deltas, and the rest (the loop, the sampler's
bookkeeping around the sampler itself).
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from benchmarks.offline.prompts import random_token_prompts
from benchmarks.offline.xllm_throughput import greedy

_ids = itertools.count()


def _decode_timings(engine: Any, batch_size: int, num_warmup: int, num_steps: int) -> list[Any]:
    """StepTimings of the pure-decode steps after ``num_warmup`` of them; drains the engine after."""
    timings, decode_seen = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        t = engine.last_step_timing
        if t is None or t.num_seqs != batch_size or t.num_tokens != batch_size:
            continue
        decode_seen += 1
        if decode_seen > num_warmup and len(timings) < num_steps:
            timings.append(t)
    return timings


def measure_eta(
    engine: Any, pool: list[int], batch_size: int, input_len: int, num_steps: int, seed: int
) -> dict:
    """η and host overhead for ``batch_size`` requests of ``input_len`` prompt tokens."""
    import torch

    from xengine.api.messages import AddRequest

    num_warmup = 4
    prompts = random_token_prompts(pool, batch_size, input_len, seed)
    for ids in prompts:
        req = AddRequest(
            req_id=f"eta-{next(_ids)}", prompt_token_ids=ids, params=greedy(num_warmup + num_steps + 2)
        )
        engine.add_request(req)
    with torch.inference_mode():  # as the engine process and ``LLM.generate`` run their steps
        timings = _decode_timings(engine, batch_size, num_warmup, num_steps)
    if not timings:
        return {"error": f"no pure-decode step with {batch_size} sequences (max_num_seqs too small?)"}
    total = sum(t.total_s for t in timings) / len(timings)
    forward = sum(t.forward_s for t in timings) / len(timings)
    sample = sum(t.sample_s for t in timings) / len(timings)
    host = statistics.median(t.total_s - t.forward_s - t.sample_s for t in timings)
    phases = {
        name: statistics.median(t.phases.get(name, 0.0) for t in timings) / batch_size * 1e6
        for name in ("schedule", "prepare", "update", "outputs")
    }
    phases["other"] = (
        statistics.median(t.total_s - t.forward_s - t.sample_s - sum(t.phases.values()) for t in timings)
        / batch_size
        * 1e6
    )
    return {
        "num_steps": len(timings),
        "step_ms": total * 1e3,
        "forward_ms": forward * 1e3,
        "sample_ms": sample * 1e3,
        "eta": total / forward if forward > 0 else None,
        # the engine's own work per request per step (median step): scheduling, inputs, output
        # processing; the forward, logits and the sampler (device work) excluded
        "host_us_per_req": host / batch_size * 1e6,
        "host_overhead_us_per_req": (total - forward) / batch_size * 1e6,  # the sampler included
        "host_phases_us_per_req": phases,
    }


def step_efficiency(
    engine: Any, pool: list[int], batch_sizes: list[int], input_len: int, num_steps: int, seed: int
) -> dict[str, dict]:
    """``measure_eta`` for each batch size, keyed by the batch size."""
    return {str(b): measure_eta(engine, pool, b, input_len, num_steps, seed + b) for b in batch_sizes}
