"""Generative-recommendation benchmark: catalog-constrained beam search in the engine; prints one JSON.

Sections:
- ``latency``: per beam width (4 .. 128) and concurrency level, the latency (mean, p99) of rec
  requests (one item of ``item_len`` tokens from a synthetic catalog), driven in-process with
  ``concurrency`` requests kept in flight.
- ``step_time``: mean engine step time with and without the catalog constraint at the same beam
  width (the constraint costs the trie lookups and the logits mask).
- ``host_selection``: the heap selector (xLLM §4.5.1) vs a full sort of every candidate.

``python -m benchmarks.rec_bench [--model DIR | --size tiny] [--widths 4,8,...] [--concurrency 1,4]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.smoke import add_smoke_flag, parse_args
from xengine.api.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from xengine.api.messages import AddRequest, SamplingParams
from xengine.engine import Engine
from xengine.sampling.beam_search import BeamSelector, select_brute_force


def synthetic_catalog(num_items: int, item_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    items: set[tuple[int, ...]] = set()
    while len(items) < num_items:
        items.add(tuple(rng.randrange(3, vocab) for _ in range(item_len)))
    return [list(i) for i in items]


def make_engine(model: str, threads: int) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=model, max_model_len=512),
            cache=CacheConfig(block_size=16, num_blocks=8192, enable_prefix_caching=True),
            scheduler=SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192, max_beam_width=128),
            device=DeviceConfig(device="cpu", num_threads=threads),
        )
    )


def rec_params(width: int, item_len: int, catalog: str | None) -> SamplingParams:
    return SamplingParams(
        n=min(width, 10),
        temperature=0.0,
        max_tokens=item_len,
        ignore_eos=True,
        use_beam_search=True,
        beam_width=width,
        length_penalty=0.0,
        beam_top_k=width,
        catalog=catalog,
    )


def run_closed_loop(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> dict:
    """Keep ``concurrency`` requests in flight until all prompts are done; latency per request."""
    pending = list(enumerate(prompts))
    started: dict[str, float] = {}
    left: dict[str, int] = {}
    latencies: list[float] = []
    step_times: list[float] = []
    t0 = time.perf_counter()
    while pending or started:
        while pending and len(started) < concurrency:
            i, prompt = pending.pop(0)
            req_id = f"r{i}-{time.perf_counter_ns()}"
            engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
            started[req_id], left[req_id] = time.perf_counter(), params.n
        for d in engine.step():
            if d.finish_reason is not None and d.req_id in left:
                left[d.req_id] -= 1
                if left[d.req_id] == 0:
                    latencies.append(time.perf_counter() - started.pop(d.req_id))
                    del left[d.req_id]
        if engine.last_step_timing is not None and engine.last_step_timing.num_seqs:
            step_times.append(engine.last_step_timing.total_s)
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "num_requests": len(prompts),
        "latency_mean_ms": round(1000 * statistics.mean(latencies), 3),
        "latency_p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        "throughput_req_s": round(len(prompts) / wall, 3),
        "step_mean_ms": round(1000 * statistics.mean(step_times), 3),
    }


def host_selection(width: int, repeats: int = 20) -> dict:
    rng = random.Random(width)
    scores = [rng.uniform(-10, 0) for _ in range(width)]
    lps = [sorted((rng.uniform(-12, 0) for _ in range(width)), reverse=True) for _ in range(width)]
    ids = [list(range(width)) for _ in range(width)]
    selector = BeamSelector(width)
    t0 = time.perf_counter()
    for _ in range(repeats):
        selector.select(scores, lps, ids)
    heap_s = (time.perf_counter() - t0) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        select_brute_force(scores, lps, ids, width)
    sort_s = (time.perf_counter() - t0) / repeats
    return {
        "beam_width": width,
        "candidates": width * width,
        "visited": selector.num_visited,
        "heap_ms": round(1000 * heap_s, 3),
        "full_sort_ms": round(1000 * sort_s, 3),
    }


SMOKE = dict(widths="4", concurrency="1", num_requests=2, num_items=100, prompt_len=8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rec_bench", description=__doc__.split("\n")[0])
    add_checkpoint_args(p)
    p.add_argument("--widths", default="4,8,16,32,64,128")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--num-items", type=int, default=10_000)
    p.add_argument("--item-len", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    add_smoke_flag(p)
    args = parse_args(p, argv, SMOKE)
    model = resolve_checkpoint(args)
    engine = make_engine(model, args.threads)
    vocab = engine.vocab_size
    info = engine.register_catalog("bench", synthetic_catalog(args.num_items, args.item_len, vocab))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    widths = [int(w) for w in args.widths.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    run_closed_loop(engine, prompts[:2], rec_params(4, args.item_len, "bench"), 2)  # warm-up
    latency = []
    for width in widths:
        for conc in levels:
            res = run_closed_loop(engine, prompts, rec_params(width, args.item_len, "bench"), conc)
            latency.append({"beam_width": width, "concurrency": conc, **res})
            print(f"width {width} concurrency {conc}: {res}", file=sys.stderr)
    step_time = []
    for width in (widths[len(widths) // 2], widths[-1]):
        row: dict[str, Any] = {"beam_width": width}
        for name, catalog in (("constrained", "bench"), ("unconstrained", None)):
            res = run_closed_loop(engine, prompts, rec_params(width, args.item_len, catalog), 1)
            row[f"{name}_step_mean_ms"] = res["step_mean_ms"]
        step_time.append(row)
        print(f"step time: {row}", file=sys.stderr)
    out = {
        "model": model,
        "catalog": {"num_items": info.num_items, "item_len": info.item_len, "trie_nodes": info.num_nodes},
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "latency": latency,
        "step_time": step_time,
        "host_selection": [host_selection(w) for w in (32, 128)],
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
