"""Expert parallelism on CPU (gloo): EP = 2 vs 1, dual-batch overlap off vs on, and an EPLB swap;
prints one JSON document.

Every measurement drives ``LLM.engine`` step by step on greedy requests (EOS ignored) and reads
``engine.last_step_timing`` after each step and ``engine.get_stats().moe`` (``MoeStatsMsg``) around
the run. Each rank runs ``--threads`` torch threads, so EP = 2 uses twice the cores of EP = 1
(``cores_used`` says how many); on a machine with fewer idle cores than that, the ranks contend.

- ``ep_scaling``: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` new
  tokens each, with expert_parallel_size 1 and 2: median step time (all steps and decode-only steps),
  output tok/s, and whether the two produced the same tokens.
- ``dual_batch_overlap``: EP = 2 with ``enable_dual_batch_overlap`` off and on, same workload: the
  communication rank 0 was blocked on per step (``comm_exposed_s / num_steps``), the overlap fraction
  ``1 - exposed_on / exposed_off``, step time, tok/s, token identity.
- ``eplb``: EP = 2 with ``enable_eplb`` and ``--num-redundant-experts`` on a skewed workload (each
  prompt one repeated token, so routing concentrates on few experts). For every swap: per-layer
  balancedness measured just before it and the mean of the measurements after it (until the next
  swap), the switch and background-load cost, and the largest step within +-2 steps of the switch
  (and over the whole load + switch span) against the median decode step. The same prompts run on
  the EPLB-off EP = 2 engine give the reference tokens.

Timed runs are repeated ``--repeats`` times (medians reported) after one warm-up run per engine; the
EPLB engine is rebuilt per repeat since a swap only happens once per placement.

    PYTHONPATH=. .venv/bin/python -m benchmarks.moe_ep --arch qwen3_moe --size tiny

See ``docs/expert_parallel.md`` and ``benchmarks/README.md``, "Expert parallelism".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.smoke import add_smoke_flag, parse_args


@dataclass
class RunResult:
    """One workload driven to completion: tokens per request, per-step timings and MoE stats."""

    tokens: dict[str, list[int]]
    step_s: list[float]
    decode_step_s: list[float]
    elapsed_s: float
    num_output_tokens: int
    moe_before: Any
    moe_after: Any
    per_step: list[dict] = field(default_factory=list)  # eplb runs: step time + MoE stats after each step


def progress(msg: str) -> None:
    print(f"[moe_ep] {msg}", file=sys.stderr, flush=True)


def drive(llm: Any, prompts: list[list[int]], output_len: int, tag: str, trace: bool = False) -> RunResult:
    """Add every prompt at once and step until all are done; with ``trace``, read the MoE stats after
    every step (rank 0's local copy: no communication)."""
    from xengine.api.messages import AddRequest, SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        tokens[rid] = []
        engine.add_request(AddRequest(req_id=rid, prompt_token_ids=p, params=params))
    moe_before = engine.get_stats().moe
    step_s, decode_s, per_step = [], [], []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.req_id in tokens:
                tokens[d.req_id].extend(d.new_token_ids)
            if d.error:
                raise RuntimeError(f"request {d.req_id} failed: {d.error}")
        t = engine.last_step_timing
        if t is None or t.num_tokens == 0:
            continue
        step_s.append(t.total_s)
        if t.num_tokens == t.num_seqs:
            decode_s.append(t.total_s)
        if trace:
            m = engine.get_stats().moe
            per_step.append(
                {"step_s": t.total_s, "decode": t.num_tokens == t.num_seqs, "balancedness": m.balancedness,
                 "balancedness_before": m.balancedness_before, "num_swaps": m.num_swaps,
                 "last_swap_s": m.last_swap_s, "last_load_s": m.last_load_s}
            )  # fmt: skip
    elapsed = time.perf_counter() - t0
    return RunResult(
        tokens=tokens, step_s=step_s, decode_step_s=decode_s, elapsed_s=elapsed,
        num_output_tokens=sum(len(v) for v in tokens.values()), moe_before=moe_before,
        moe_after=engine.get_stats().moe, per_step=per_step,
    )  # fmt: skip


def token_lists(run: RunResult) -> list[list[int]]:
    return [run.tokens[k] for k in sorted(run.tokens, key=lambda k: int(k.rsplit("-", 1)[1]))]


def ms(x: float) -> float:
    return round(x * 1e3, 3)


def timing_summary(runs: list[RunResult]) -> dict:
    """Medians over repeats of each run's median step, median decode step and output tok/s."""
    step = statistics.median(statistics.median(r.step_s) for r in runs)
    decode = statistics.median(statistics.median(r.decode_step_s) for r in runs if r.decode_step_s)
    tok_s = statistics.median(r.num_output_tokens / r.elapsed_s for r in runs)
    return {
        "median_step_ms": ms(step), "median_decode_step_ms": ms(decode), "output_tok_s": round(tok_s, 1),
        "num_steps": len(runs[0].step_s), "elapsed_s": [round(r.elapsed_s, 3) for r in runs],
    }  # fmt: skip


def exposed_per_step(run: RunResult) -> tuple[float, int, int]:
    """(exposed communication seconds per step, steps, bytes sent) of one run, from the stats delta."""
    a, b = run.moe_before, run.moe_after
    steps = b.num_steps - a.num_steps
    return (b.comm_exposed_s - a.comm_exposed_s) / max(steps, 1), steps, b.comm_bytes_sent - a.comm_bytes_sent


def make_llm(model_dir: str, args: argparse.Namespace, **overrides: Any) -> Any:
    from xengine.llm import LLM

    kwargs = dict(
        dtype="float32", num_threads=args.threads, max_num_seqs=max(args.num_prompts, args.eplb_prompts),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024,
        graph_mode=args.graph_mode, async_scheduling=args.async_scheduling,
    )  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(model_dir, **(kwargs | overrides))
    progress(f"engine {overrides} ready in {time.perf_counter() - t0:.1f}s")
    return llm


def warm_up(llm: Any, prompts: list[list[int]]) -> None:
    drive(llm, prompts[:2], 4, "warm")


def timed_runs(llm: Any, prompts: list[list[int]], args: argparse.Namespace, tag: str) -> list[RunResult]:
    warm_up(llm, prompts)
    return [drive(llm, prompts, args.output_len, f"{tag}{i}") for i in range(args.repeats)]


def identical(runs_a: list[RunResult], runs_b: list[RunResult]) -> bool:
    ref = token_lists(runs_a[0])
    return all(token_lists(r) == ref for r in runs_a + runs_b)


def skewed_prompts(pool: list[int], num: int, length: int, num_distinct: int, seed: int) -> list[list[int]]:
    """``num`` prompts, each one token repeated ``length`` times, cycling over ``num_distinct`` tokens:
    the router sends almost every token of a prompt to the same few experts."""
    rng = random.Random(seed)
    toks = rng.sample(pool, num_distinct)
    return [[toks[i % num_distinct]] * length for i in range(num)]


def swap_reports(run: RunResult) -> list[dict]:
    """Per EPLB swap of one traced run: balancedness before / after, its cost, and step times near it."""
    steps = run.per_step
    decode_median = statistics.median(s["step_s"] for s in steps if s["decode"])
    out = []
    for k in range(1, steps[-1]["num_swaps"] + 1 if steps else 1):
        at = next(i for i, s in enumerate(steps) if s["num_swaps"] >= k)  # the step whose start switched
        prev = at - 1
        # the rebalancing decision: the last step before the switch at which balancedness_before (set by
        # the decision) changed; the background load runs from there to the switch
        decided = max(
            (
                i
                for i in range(1, at)
                if steps[i]["balancedness_before"] != steps[i - 1]["balancedness_before"]
            ),
            default=at,
        )
        before = steps[prev]["balancedness"] if prev >= 0 else []
        after_vals: list[list[float]] = []
        last = before
        for s in steps[at + 1 :]:
            if s["num_swaps"] > k:
                break
            if s["balancedness"] != last:  # a fresh measurement (every few steps), over post-swap steps only
                after_vals.append(s["balancedness"])
                last = s["balancedness"]
        after = [statistics.mean(col) for col in zip(*after_vals)] if after_vals else []
        # each step against the median step of its kind (prefill-chunk steps are slower than decode ones)
        kind_median = {
            kind: statistics.median([s["step_s"] for s in steps if s["decode"] == kind] or [1.0])
            for kind in (True, False)
        }
        near = [s["step_s"] / kind_median[s["decode"]] for s in steps[max(0, at - 2) : at + 3]]
        span = [s["step_s"] / kind_median[s["decode"]] for s in steps[max(0, decided - 2) : at + 3]]
        out.append({
            "swap": k, "at_step": at, "decided_at_step": decided,
            "balancedness_before": [round(x, 4) for x in before],
            "balancedness_before_mean": round(statistics.mean(before), 4) if before else None,
            "balancedness_after": [round(x, 4) for x in after],
            "balancedness_after_mean": round(statistics.mean(after), 4) if after else None,
            "num_after_measurements": len(after_vals),
            "swap_ms": ms(steps[at]["last_swap_s"]), "load_ms": ms(steps[at]["last_load_s"]),
            "max_step_within_2_over_median_same_kind": round(max(near), 3),
            "max_step_load_to_swap_over_median_same_kind": round(max(span), 3),
            "median_decode_step_ms": ms(decode_median),
            # step index -> ms, from 2 steps before the decision to 2 after the switch
            "steps_near_ms": {i: ms(steps[i]["step_s"]) for i in range(max(0, decided - 2), at + 3)
                              if i < len(steps)},
        })  # fmt: skip
    return out


def shutdown(llm: Any) -> None:
    llm.shutdown()
    layout = getattr(llm.engine.kv_setup, "layout", None)
    if layout is not None and hasattr(layout, "close"):
        layout.close()


SMOKE = dict(
    num_prompts=2, input_len=8, output_len=2, repeats=1, eplb_prompts=2, eplb_input_len=16, eplb_output_len=2,
    eplb_batched_tokens=8,
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="MoE HF folder (overrides --arch/--size)")
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3"])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--graph-mode", default="eager", choices=["eager", "partial"])
    p.add_argument("--async-scheduling", default="off", choices=["on", "off"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eplb-prompts", type=int, default=16)
    p.add_argument("--eplb-input-len", type=int, default=256)
    p.add_argument("--eplb-output-len", type=int, default=16)
    p.add_argument(
        "--eplb-batched-tokens", type=int, default=128,
        help="token budget of the EPLB engines: the skewed prompts prefill in chunks over many steps",
    )  # fmt: skip
    p.add_argument(
        "--eplb-distinct-tokens", type=int, default=2, help="distinct tokens of the skewed prompts"
    )
    p.add_argument("--num-redundant-experts", type=int, default=2)
    p.add_argument("--eplb-window", type=int, default=8)
    p.add_argument(
        "--eplb-interval", type=int, default=None,
        help="steps between rebalancing decisions (default: about half the run, so exactly one decision)",
    )  # fmt: skip
    p.add_argument("--skip", nargs="*", default=[], choices=["ep_scaling", "dual_batch_overlap", "eplb"])
    p.add_argument("--seed", type=int, default=0)
    add_smoke_flag(p)
    args = parse_args(p, argv, SMOKE)

    from benchmarks.offline.prompts import prompt_id_pool, random_token_prompts

    model_dir = str(args.model or generated_checkpoint(args.arch, args.size))
    load = os.getloadavg()
    report: dict[str, Any] = {
        "config": vars(args) | {"model_dir": model_dir},
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "load_avg": [round(x, 2) for x in load]},
        "threads_per_rank": args.threads,
        "cores_used": {"ep1": args.threads, "ep2": 2 * args.threads},
    }  # fmt: skip
    if load[0] > 0.5 * (os.cpu_count() or 1):
        report["machine"]["note"] = "1-minute load average was high before timing; step times may be inflated"
    pool = prompt_id_pool(model_dir)
    prompts = random_token_prompts(pool, args.num_prompts, args.input_len, args.seed)
    skewed = skewed_prompts(
        pool, args.eplb_prompts, args.eplb_input_len, args.eplb_distinct_tokens, args.seed
    )
    t_start = time.perf_counter()

    # EP = 1 (single process)
    ep1_runs: list[RunResult] = []
    if "ep_scaling" not in args.skip:
        llm = make_llm(model_dir, args)
        try:
            ep1_runs = timed_runs(llm, prompts, args, "ep1-")
        finally:
            shutdown(llm)
        del llm

    # EP = 2, dual-batch overlap off (also the EPLB-off reference for the skewed prompts)
    llm = make_llm(model_dir, args, expert_parallel_size=2)
    try:
        off_runs = timed_runs(llm, prompts, args, "ep2-")
        skew_ref = drive(llm, skewed, args.eplb_output_len, "skew-ref") if "eplb" not in args.skip else None
    finally:
        shutdown(llm)
    del llm

    if ep1_runs:
        one, two = timing_summary(ep1_runs), timing_summary(off_runs)
        report["ep_scaling"] = {
            "ep1": one, "ep2": two,
            "ep2_over_ep1_tok_s": round(two["output_tok_s"] / one["output_tok_s"], 3),
            "ep2_over_ep1_decode_step": round(two["median_decode_step_ms"] / one["median_decode_step_ms"], 3),
            "tokens_identical": identical(ep1_runs, off_runs),
        }  # fmt: skip

    if "dual_batch_overlap" not in args.skip:
        llm = make_llm(model_dir, args, expert_parallel_size=2, enable_dual_batch_overlap=True)
        try:
            on_runs = timed_runs(llm, prompts, args, "dbo-")
        finally:
            shutdown(llm)
        del llm
        section: dict[str, Any] = {}
        exposed = {}
        for name, runs in (("off", off_runs), ("on", on_runs)):
            per = [exposed_per_step(r) for r in runs]
            exposed[name] = statistics.median(x[0] for x in per)
            section[name] = timing_summary(runs) | {
                "exposed_comm_ms_per_step": ms(exposed[name]),
                "moe_steps": per[0][1],
                "comm_mb_sent": round(per[0][2] / 1e6, 3),
            }
        section["overlap_fraction"] = (
            round(1 - exposed["on"] / exposed["off"], 3) if exposed["off"] > 0 else None
        )
        section["on_over_off_decode_step"] = round(
            section["on"]["median_decode_step_ms"] / section["off"]["median_decode_step_ms"], 3
        )
        section["tokens_identical"] = identical(off_runs, on_runs)
        report["dual_batch_overlap"] = section

    if "eplb" not in args.skip:
        assert skew_ref is not None
        warm_steps = 4 + 1  # warm_up: 4 tokens, one prefill step
        prefill_steps = math.ceil(args.eplb_prompts * args.eplb_input_len / args.eplb_batched_tokens)
        interval = args.eplb_interval or warm_steps + max(prefill_steps // 3, args.eplb_window)
        runs, swaps = [], []
        for i in range(args.repeats):
            llm = make_llm(
                model_dir, args, expert_parallel_size=2, enable_eplb=True,
                num_redundant_experts=args.num_redundant_experts, eplb_interval=interval,
                eplb_window=args.eplb_window, max_num_batched_tokens=args.eplb_batched_tokens,
                enable_prefix_caching=False,  # the skewed prompts repeat: every run prefills them whole
            )  # fmt: skip
            try:
                warm_up(llm, skewed)
                run = drive(llm, skewed, args.eplb_output_len, f"eplb{i}", trace=True)
            finally:
                shutdown(llm)
            del llm
            runs.append(run)
            swaps.append(swap_reports(run))
        first = [s[0] for s in swaps if s]
        section = {
            "eplb_interval": interval, "eplb_window": args.eplb_window,
            "num_redundant_experts": args.num_redundant_experts,
            "swaps_per_run": [len(s) for s in swaps],
            "median_step_ms": ms(statistics.median(statistics.median(r.step_s) for r in runs)),
            "median_decode_step_ms": ms(statistics.median(statistics.median(r.decode_step_s) for r in runs)),
            "reference_median_decode_step_ms": ms(statistics.median(skew_ref.decode_step_s)),
            "tokens_identical_to_eplb_off": all(token_lists(r) == token_lists(skew_ref) for r in runs),
        }  # fmt: skip
        if first:
            section["first_swap_median"] = {
                key: round(statistics.median(s[key] for s in first if s[key] is not None), 4)
                for key in ("balancedness_before_mean", "balancedness_after_mean", "swap_ms", "load_ms",
                            "max_step_within_2_over_median_same_kind",
                            "max_step_load_to_swap_over_median_same_kind")
                if any(s[key] is not None for s in first)
            }  # fmt: skip
        section["swaps"] = swaps
        report["eplb"] = section

    report["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
