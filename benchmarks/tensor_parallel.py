"""Tensor parallelism on CPU: decode throughput of TP = 2 at one thread per rank against TP = 1 at two
threads (the same two cores), and the KV pool's capacity per rank; prints one JSON document.

- ``decode``: for each batch size, ``B`` random prompts of ``--input-len`` tokens generate
  ``--output-len`` tokens each (greedy, EOS ignored) on ``LLM.engine`` step by step; the median decode
  step (steps whose every sequence adds one token), decode tok/s = B / median step, output tok/s over the
  whole run; the ratio TP = 2 / TP = 1 and whether both produced the same tokens. Both engines are up
  at once and their ``--repeats`` runs alternate after a warm-up (medians reported), so the drift of a
  shared virtual machine's speed hits both alike.
- ``moe``: the same decode workload on ``--moe-arch`` at B = the two largest batch sizes: today's expert
  parallelism alone (EP = 2: attention and dense layers replicated on both ranks, experts exchanged by
  all-to-all over gloo) against TP = 2 (attention and dense layers split, experts split over the same
  two ranks and summed by the shared-memory all-reduce), one thread per rank each.
- ``kv_capacity``: the tokens the KV pool holds with the same ``--kv-memory-gb`` per rank at TP = 1, 2,
  4 (a rank keeps its KV heads only; a KV head is replicated once the group outnumbers them).

    PYTHONPATH=. .venv/bin/python -m benchmarks.tensor_parallel --size small

See ``docs/tensor_parallel.md`` and ``benchmarks/README.md``, "Tensor parallelism".
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args


def progress(msg: str) -> None:
    print(f"[tensor_parallel] {msg}", file=sys.stderr, flush=True)


def drive(llm: Any, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """Every prompt at once, stepped to completion: tokens, decode step times, elapsed seconds."""
    from xengine.api.messages import AddRequest, SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        tokens[i] = []
        engine.add_request(AddRequest(req_id=f"{tag}-{i}", prompt_token_ids=p, params=params))
    decode_s: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.error:
                raise RuntimeError(f"request {d.req_id} failed: {d.error}")
            tokens[int(d.req_id.rsplit("-", 1)[1])].extend(d.new_token_ids)
        t = engine.last_step_timing
        if t is not None and t.num_tokens and t.num_tokens == t.num_seqs == len(prompts):
            decode_s.append(t.total_s)
    return {"tokens": [tokens[i] for i in range(len(prompts))], "decode_s": decode_s,
            "elapsed_s": time.perf_counter() - t0}  # fmt: skip


def measure(
    model: str, tp: int, threads: int, batches: list[list[list[int]]], args: argparse.Namespace, ep: int = 1
) -> dict:
    from xengine.llm import LLM

    t0 = time.perf_counter()
    with LLM(
        model, tensor_parallel_size=tp, expert_parallel_size=ep, num_threads=threads, dtype="float32",
        max_model_len=1024, max_num_seqs=max(len(b) for b in batches), graph_mode=args.graph_mode,
        async_scheduling="off",
    ) as llm:  # fmt: skip
        progress(f"TP={tp} EP={ep} x {threads} thread(s) ready in {time.perf_counter() - t0:.1f}s")
        drive(llm, batches[0][:2], 4, "warm")
        out = {}
        for prompts in batches:
            runs = [drive(llm, prompts, args.output_len, f"r{i}") for i in range(args.repeats)]
            out[len(prompts)] = summary(runs, len(prompts), args.output_len)
            progress(
                f"TP={tp} EP={ep} B={len(prompts)}: decode step {out[len(prompts)]['median_decode_step_ms']} ms"
            )
        moe = llm.engine.get_stats().moe
        out["all_reduces"] = moe.num_all_reduces if moe is not None else 0
    return out


def paired(model: str, batches: list[list[list[int]]], args: argparse.Namespace) -> tuple[dict, dict]:
    """TP = 1 at two threads and TP = 2 at one thread per rank, both engines up, their runs alternating
    (A B A B ...) so that drift of this machine's speed hits both alike."""
    import torch

    from xengine.llm import LLM

    kw = dict(dtype="float32", max_model_len=1024, max_num_seqs=max(len(b) for b in batches),
              graph_mode=args.graph_mode, async_scheduling="off")  # fmt: skip
    one = LLM(model, tensor_parallel_size=1, num_threads=2, **kw)  # built first: its layers stay plain
    two = LLM(model, tensor_parallel_size=2, num_threads=1, **kw)
    engines = {1: (one, 2), 2: (two, 1)}
    try:
        for llm, threads in engines.values():
            torch.set_num_threads(threads)
            drive(llm, batches[0][:2], 4, "warm")
        out: dict[int, dict] = {1: {}, 2: {}}
        for prompts in batches:
            runs: dict[int, list[dict]] = {1: [], 2: []}
            for i in range(args.repeats):
                for tp, (llm, threads) in engines.items():
                    torch.set_num_threads(threads)
                    runs[tp].append(drive(llm, prompts, args.output_len, f"r{i}"))
            for tp in (1, 2):
                out[tp][len(prompts)] = summary(runs[tp], len(prompts), args.output_len)
            progress(f"B={len(prompts)}: decode step TP=1 {out[1][len(prompts)]['median_decode_step_ms']} ms, "
                     f"TP=2 {out[2][len(prompts)]['median_decode_step_ms']} ms")  # fmt: skip
        moe = two.engine.get_stats().moe
        out[2]["all_reduces"] = moe.num_all_reduces if moe is not None else 0
        return out[1], out[2]
    finally:
        two.shutdown()
        one.shutdown()


def summary(runs: list[dict], batch: int, output_len: int) -> dict:
    step = statistics.median(statistics.median(r["decode_s"]) for r in runs)
    return {
        "median_decode_step_ms": round(step * 1e3, 3),
        "decode_tok_s": round(batch / step, 1),
        "output_tok_s": round(statistics.median(batch * output_len / r["elapsed_s"] for r in runs), 1),
        "tokens": runs[0]["tokens"],
    }


def kv_capacity(model: str, gb: float) -> dict:
    from xengine.llm import LLM

    tokens = {}
    for tp in (1, 2, 4):
        with LLM(
            model, tensor_parallel_size=tp, num_threads=1, kv_cache_memory_gb=gb, dtype="float32"
        ) as llm:
            pool = llm.engine.kv.pool
            tokens[tp] = pool.num_blocks * llm.engine.kv.block_size
    return {"kv_memory_gb_per_rank": gb, "tokens": tokens,
            "ratio_vs_tp1": {tp: round(n / tokens[1], 3) for tp, n in tokens.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tensor_parallel", description=__doc__.split("\n")[0]
    )
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--moe-arch", default="qwen3_moe")
    p.add_argument("--size", default="small")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--graph-mode", default="eager")
    p.add_argument("--kv-memory-gb", type=float, default=0.25)
    add_smoke_flag(p)
    args = parse_args(
        p, argv, dict(size="tiny", batch_sizes="1,4", output_len=8, repeats=1, kv_memory_gb=0.01)
    )
    model = str(generated_checkpoint(args.arch, args.size))
    rng = random.Random(0)
    batches = [
        [[rng.randrange(3, 1000) for _ in range(args.input_len)] for _ in range(int(b))]
        for b in args.batch_sizes.split(",")
    ]
    one, two = paired(model, batches, args)
    decode = {}
    for prompts in batches:
        b = len(prompts)
        a, c = one[b], two[b]
        decode[b] = {
            "tp1_2threads": {k: v for k, v in a.items() if k != "tokens"},
            "tp2_1thread_per_rank": {k: v for k, v in c.items() if k != "tokens"},
            "tp2_vs_tp1_decode": round(c["decode_tok_s"] / a["decode_tok_s"], 3),
            "identical_tokens": a["tokens"] == c["tokens"],
        }
    moe_model = str(generated_checkpoint(args.moe_arch, args.size))
    moe_batches = batches[-2:]
    ep2 = measure(moe_model, 1, 1, moe_batches, args, ep=2)
    tp2 = measure(moe_model, 2, 1, moe_batches, args)
    moe = {"arch": args.moe_arch}
    for prompts in moe_batches:
        b = len(prompts)
        moe[b] = {
            "ep2_replicated_attention": {k: v for k, v in ep2[b].items() if k != "tokens"},
            "tp2_ep2": {k: v for k, v in tp2[b].items() if k != "tokens"},
            "tp2_vs_ep2_decode": round(tp2[b]["decode_tok_s"] / ep2[b]["decode_tok_s"], 3),
            "identical_tokens": ep2[b]["tokens"] == tp2[b]["tokens"],
        }
    result = {
        "benchmark": "tensor_parallel",
        "machine": describe(threads_per_process=1),
        "model": {"arch": args.arch, "size": args.size, "dtype": "float32"},
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "graph_mode": args.graph_mode,
        },  # fmt: skip
        "cores_used": 2,
        "decode": decode,
        "all_reduces_tp2": two["all_reduces"],
        "moe": moe,
        "kv_capacity": kv_capacity(model, args.kv_memory_gb),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
