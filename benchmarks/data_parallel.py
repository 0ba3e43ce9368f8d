"""Data-parallel attention for MoE on CPU: output throughput of DP = 2 (+ EP = 2) against today's expert
parallelism with replicated attention (EP = 2) and against TP = 2 (experts split over the same ranks),
one thread per rank on the same two cores; prints one JSON document.

For each batch size ``B``, ``B`` random prompts of ``--input-len`` tokens generate ``--output-len``
tokens each (greedy, EOS ignored), all sent at once through the service's engine client (the same
async driver for every layout: ``EngineClient`` for EP and TP, ``DataParallelClient`` for DP, which
spreads the requests over its ranks). Output tok/s = B * output_len / elapsed, and the mean time per
output token seen by a request. Layouts run one after another (one instance up at a time: an idle
data-parallel instance still wakes every few ms), ``--repeats`` rounds alternating the layouts, medians
reported; ratios DP / EP and DP / TP; whether each layout produced EP's tokens. ``kv_capacity``: the
tokens each layout's instance holds with ``--kv-memory-gb`` of KV per rank (EP replicates the KV; TP
cannot split an MLA model's one latent KV head; DP's ranks each hold their own requests' KV).

    PYTHONPATH=. .venv/bin/python -m benchmarks.data_parallel --arch deepseek_v3 --size small

See ``docs/tensor_parallel.md`` (data-parallel attention) and ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args

LAYOUTS = {  # name -> parallel config fields (one thread per rank, two ranks each)
    "ep2_replicated_attention": dict(expert_parallel_size=2),
    "tp2_ep2": dict(tensor_parallel_size=2),
    "dp2_ep2": dict(data_parallel_size=2),
}


def progress(msg: str) -> None:
    print(f"[data_parallel] {msg}", file=sys.stderr, flush=True)


async def drive(client: Any, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """Every prompt at once: tokens and elapsed seconds."""
    from xengine.api.messages import AddRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> tuple[list[int], float]:
        tokens: list[int] = []
        first = 0.0
        async for delta in client.generate(
            AddRequest(req_id=f"{tag}-{i}", prompt_token_ids=prompt, params=params)
        ):
            if delta.error:
                raise RuntimeError(f"request {tag}-{i} failed: {delta.error}")
            if not tokens and delta.new_token_ids:
                first = time.perf_counter()
            tokens += delta.new_token_ids
        tpot = (time.perf_counter() - first) / max(1, len(tokens) - 1)
        return tokens, tpot

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {
        "tokens": [t for t, _ in done],
        "elapsed_s": time.perf_counter() - t0,
        "mean_tpot_s": statistics.mean(s for _, s in done),
    }


async def measure(model: str, layout: str, batches: list[list[list[int]]], args: argparse.Namespace) -> dict:
    """One instance of ``layout`` up: a warm-up, then each batch once."""
    from xengine.llm import engine_config
    from xservice.engine.data_parallel import start_engine_client

    config = engine_config(
        model, num_threads=1, dtype="float32", max_model_len=1024, graph_mode=args.graph_mode,
        async_scheduling="off", max_num_seqs=max(len(b) for b in batches),
    )  # fmt: skip
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **LAYOUTS[layout]))
    client = await start_engine_client(config, 600)
    try:
        await drive(client, batches[0][:2], 4, "warm")
        return {len(p): await drive(client, p, args.output_len, f"b{len(p)}") for p in batches}
    finally:
        await client.close()


async def kv_capacity(model: str, gb: float) -> dict:
    """The tokens each layout's instance holds in its KV pool with ``gb`` of KV memory per rank."""
    from xengine.llm import engine_config
    from xservice.engine.data_parallel import start_engine_client

    tokens = {}
    for name, fields in LAYOUTS.items():
        config = engine_config(model, num_threads=1, dtype="float32", kv_cache_memory_gb=gb)
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **fields))
        client = await start_engine_client(config, 600)
        try:
            tokens[name] = client.info.num_total_blocks * client.info.block_size
        finally:
            await client.close()
    base = tokens["ep2_replicated_attention"]
    return {"kv_memory_gb_per_rank": gb, "tokens": tokens,
            "ratio_vs_ep2": {n: round(t / base, 3) for n, t in tokens.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data_parallel", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="deepseek_v3")
    p.add_argument("--size", default="small")
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--graph-mode", default="eager")
    p.add_argument("--kv-memory-gb", type=float, default=0.05)
    add_smoke_flag(p)
    args = parse_args(p, argv, dict(size="tiny", batch_sizes="4", output_len=8, repeats=1, kv_memory_gb=0.01))
    model = str(generated_checkpoint(args.arch, args.size))
    rng = random.Random(0)
    batches = [
        [[rng.randrange(3, 1000) for _ in range(args.input_len)] for _ in range(int(b))]
        for b in args.batch_sizes.split(",")
    ]
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for r in range(args.repeats):
        for name in LAYOUTS:
            t0 = time.perf_counter()
            runs[name].append(asyncio.run(measure(model, name, batches, args)))
            progress(f"round {r + 1}/{args.repeats} {name}: {time.perf_counter() - t0:.1f}s")
    results: dict[str, Any] = {}
    for prompts in batches:
        b = len(prompts)
        row: dict[str, Any] = {}
        for name in LAYOUTS:
            each = [run[b] for run in runs[name]]
            row[name] = {
                "output_tok_s": round(
                    statistics.median(b * args.output_len / e["elapsed_s"] for e in each), 1
                ),
                "mean_tpot_ms": round(statistics.median(e["mean_tpot_s"] for e in each) * 1e3, 2),
                "identical_tokens_to_ep2": each[0]["tokens"]
                == runs["ep2_replicated_attention"][0][b]["tokens"],
            }
        ep, tp, dp = (row[n]["output_tok_s"] for n in LAYOUTS)
        row["dp2_vs_ep2"] = round(dp / ep, 3)
        row["dp2_vs_tp2"] = round(dp / tp, 3)
        results[b] = row
        progress(f"B={b}: DP/EP {row['dp2_vs_ep2']}x, DP/TP {row['dp2_vs_tp2']}x")
    print(json.dumps({
        "benchmark": "data_parallel",
        "machine": describe(threads_per_process=1),
        "model": {"arch": args.arch, "size": args.size, "dtype": "float32"},
        "workload": {"input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
                     "graph_mode": args.graph_mode, "ranks": 2, "threads_per_rank": 1},
        "cores_used": 2,
        "results": results,
        "kv_capacity": asyncio.run(kv_capacity(model, args.kv_memory_gb)),
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
