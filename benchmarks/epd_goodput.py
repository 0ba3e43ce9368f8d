"""EPD profiler check: does the strategy ``xllm profile epd`` chooses reach the goodput of every fixed one?

``PYTHONPATH=. .venv/bin/python -m benchmarks.epd_goodput [--quick] [--model DIR] [--instances 3]
[--workloads image-heavy,text-heavy] [--rates image-heavy:4,8,12,16] [--cores 2] [--slo image-heavy:TTFT_MS:TPOT_MS]``

For each workload (the profiler's ``WORKLOADS``; ``--quick`` shortens text-heavy's output): run the
profiler (``run_profile``, 1 engine thread, the instances' own setting) with ``--instances`` and the
workload's SLOs, take its choice, and the best split of every strategy from its own table (colocated
``EPD`` = ``epd.strategy: none`` with plain instances, ``E+P+D``, ``EP+D``, ``ED+P``). ``--cores C``
tells the profiler the instances share C cores (default: one core each, its own default); the choice
under the other assumption (this machine's cores, or one each) is printed beside, with its measured
goodput when it is one of the deployments run. Every deployment then runs for real, all up at once
(``benchmarks/epd_deploy.py``): ``xllm serve --config configs/cluster-epd.yaml`` with those instances
(engine processes, 1 thread each, Mooncake over TCP) and the profiler's budgets as engine config. Each
rate of the sweep drives a seeded Poisson open-loop load of the workload's requests (fresh random
images of its size, its prompt and output lengths, streamed chat completions) at each deployment in
turn, the same requests for each, the order rotated per rate. Per request TTFT and TPOT (vLLM's
definitions, ``benchmarks/serving/metrics.py``); goodput = requests/s meeting both SLOs, attainment =
the share that does. A deployment's goodput is the best of its sweep.

Prints one JSON line per (workload, deployment), then one summary line per workload and an overall
one with ``chosen_goodput >= max_fixed_goodput`` as measured (the chosen deployment is one of the
fixed ones: the best split of its strategy; it runs once). See ``docs/multimodal.md``, "EPD profiler".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.epd_deploy import epd_stages, measure, start, warm_up  # noqa: E402
from benchmarks.epd_ttft import tiny_vl  # noqa: E402
from xservice.cluster.epd.profiler import WORKLOADS, ProfileRequest, run_profile  # noqa: E402
from xservice.policies.epd import EPDSLO, STRATEGIES, EPDWorkload, StageCosts, choose_strategy  # noqa: E402

SLOS_MS = {"image-heavy": (500.0, 25.0), "text-heavy": (300.0, 15.0)}  # (TTFT, TPOT) per workload
RATES = {"image-heavy": (4.0, 8.0, 12.0, 16.0), "text-heavy": (4.0, 8.0, 12.0, 16.0)}  # requests/s swept
QUICK_OUTPUT_TOKENS = {"text-heavy": 64}  # --quick: shorter outputs, so a run fits in ~15 minutes


def deployments(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The best row (split) of every strategy in the profiler's table; the chosen one flagged."""
    chosen = report["choice"]
    rows = []
    for strategy in STRATEGIES:
        row = next((r for r in report["strategies"] if r["strategy"] == strategy), None)
        if row is not None:
            same = row["strategy"] == chosen["strategy"] and row["counts"] == chosen["counts"]
            rows.append({**row, "chosen": same})
    return rows


def engine_flags(report: dict[str, Any]) -> list[str]:
    """The profiler's measured Algorithm 1 budgets as ``xllm serve`` flags (every instance alike; the
    token budget at least 512, so that no deployment chunks the workload's prompts into many steps)."""
    cfg = report["budgets"]["measured"]["config"]
    return [
        "--max-encode-images", str(cfg["scheduler.max_encode_images"]),
        "--max-encode-tokens", str(cfg["scheduler.max_encode_tokens"]),
        "--max-num-batched-tokens", str(max(cfg["scheduler.max_num_batched_tokens"], 512)),
    ]  # fmt: skip


def run_workload(
    workload: str, spec: dict[str, Any], report: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every deployment up at once; each rate of the sweep runs on each of them in turn (the order
    rotated per rate, the requests the same); one row per deployment."""
    rows = deployments(report)
    sweeps: list[list[dict[str, Any]]] = [[] for _ in rows]
    with contextlib.ExitStack() as stack:
        deps = [start(stack, row, i, args.model, engine_flags(report)) for i, row in enumerate(rows)]
        for dep in deps:
            warm_up(dep, args.model, spec)
        for i, rate in enumerate(args.rates[workload]):
            for j in [(i + k) % len(deps) for k in range(len(deps))]:
                load_avg = os.getloadavg()[0]  # other processes on these cores: recorded, not removed
                point = measure(
                    deps[j], args.model, spec, rate, args.seconds_per_rate, args.seed + i, args.slos[workload]
                )
                sweeps[j].append({**point, "load_avg_1m_before": round(load_avg, 2)})
                print(
                    f"{workload} {rows[j]['strategy']} at {rate:g}/s: goodput {point['goodput']}",
                    file=sys.stderr,
                )
        stages = [epd_stages(dep) for dep in deps]
    ttft_ms, tpot_ms = args.slos[workload]
    return [
        {
            "workload": workload,
            "strategy": row["strategy"],
            "counts": row["counts"],
            "chosen": row["chosen"],
            "epd_strategy": dep.epd_strategy,
            "instances": dep.instances,
            "predicted_goodput": round(row["goodput"], 3),
            "predicted_limit": row["limit"],
            "slo_ms": {"ttft": ttft_ms, "tpot": tpot_ms},
            "goodput": max(p["goodput"] for p in sweep),
            "sweep": sweep,
            "epd_stages": stage,
        }
        for row, dep, sweep, stage in zip(rows, deps, sweeps, stages, strict=True)
    ]


def workload_spec(name: str, quick: bool) -> dict[str, Any]:
    spec = dict(WORKLOADS[name])
    if quick and name in QUICK_OUTPUT_TOKENS:
        spec["output_tokens"] = QUICK_OUTPUT_TOKENS[name]
    return spec


def profile(workload: str, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ttft_ms, tpot_ms = args.slos[workload]
    req = ProfileRequest(
        model=args.model, slo=EPDSLO(ttft_ms / 1e3, tpot_ms / 1e3), num_instances=args.instances,
        threads=1, repeats=args.repeats, max_batch=16, max_images=4, max_encode_images=8,
        max_prefill_tokens=1024, cores=args.cores, **spec,
    )  # fmt: skip
    return run_profile(req, lambda what: print(f"profile {workload}: {what}", file=sys.stderr))


def profile_line(workload: str, report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """What the profiler measured and chose, and what it would choose with one core per instance."""
    c = report["costs"]
    t = c["transfer"]
    costs = StageCosts(
        *c["encode"]["coef"], *c["prefill"]["coef"], *c["decode"]["coef"],
        embed_bytes_per_token=t["embed_bytes_per_token"], kv_bytes_per_token=t["kv_bytes_per_token"],
        transfer_bytes_per_s=t["bytes_per_s"], transfer_s=t["latency_s"], max_num_seqs=c["max_num_seqs"],
    )  # fmt: skip
    w = report["workload"]
    fields = ("images_per_request", "image_tokens_per_image", "patches_per_image", "prompt_tokens")
    load = EPDWorkload(*(w[k] for k in fields), w["output_tokens"])
    ttft_ms, tpot_ms = args.slos[workload]
    other = None if args.cores else float(os.cpu_count() or 1)
    alt = choose_strategy(costs, load, args.instances, EPDSLO(ttft_ms / 1e3, tpot_ms / 1e3), cores=other)
    return {
        "profile": workload,
        "instances": args.instances,
        "cores": args.cores,
        "costs": {k: c[k]["coef"] for k in ("encode", "prefill", "decode")},
        "choice": report["choice"],
        "alternative": {"cores": other, "choice": alt.best.state()},
        "budgets": report["budgets"]["measured"]["config"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a Qwen2-VL / Qwen2.5-VL folder (default: tiny Qwen2-VL)")
    p.add_argument("--workloads", default="image-heavy,text-heavy")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument(
        "--cores", type=float, default=0.0,
        help="cores the instances share, for the profiler's model (default 0: one core each)",
    )  # fmt: skip
    p.add_argument("--rates", action="append", default=[], metavar="WORKLOAD:R1,R2,..")
    p.add_argument("--slo", action="append", default=[], metavar="WORKLOAD:TTFT_MS:TPOT_MS")
    p.add_argument("--seconds-per-rate", type=float, default=20.0, help="requests per rate = rate x this")
    p.add_argument("--repeats", type=int, default=3, help="profiler repeats per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="shorter sweeps and text-heavy outputs (~15 min)")
    args = p.parse_args()
    args.model = args.model or tiny_vl()
    args.cores = args.cores or None
    if args.quick:
        args.seconds_per_rate = min(args.seconds_per_rate, 10.0)
        args.repeats = 1
    args.rates = {
        **RATES,
        **{w: tuple(map(float, r.split(","))) for w, r in (x.split(":") for x in args.rates)},
    }
    args.slos = dict(SLOS_MS)
    for item in args.slo:
        w, ttft, tpot = item.split(":")
        args.slos[w] = (float(ttft), float(tpot))
    summaries = []
    for workload in args.workloads.split(","):
        spec = workload_spec(workload, args.quick)
        report = profile(workload, spec, args)
        line = profile_line(workload, report, args)
        print(json.dumps(line), flush=True)
        rows = run_workload(workload, spec, report, args)
        for row in rows:
            print(json.dumps(row), flush=True)
        summaries.append(summary(workload, spec, line["alternative"], rows))
        print(json.dumps(summaries[-1]), flush=True)
    print(
        json.dumps(
            {
                "summary": "all",
                "chosen_reaches_best_fixed": all(s["chosen_goodput_ge_max_fixed"] for s in summaries),
            }
        )
    )


def summary(
    workload: str, spec: dict[str, Any], alternative: dict[str, Any], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chosen deployment against the best fixed one, as measured; and the alternative choice's."""
    chosen = next(r for r in rows if r["chosen"])
    best_fixed = max(rows, key=lambda r: r["goodput"])
    alt = alternative["choice"]
    alt_row = next(
        (r for r in rows if (r["strategy"], r["counts"]) == (alt["strategy"], alt["counts"])), None
    )
    return {
        "summary": workload,
        "workload": {**spec, "image_size": list(spec["image_size"])},
        "choice": f"{chosen['strategy']} {chosen['instances']}",
        "chosen_goodput": chosen["goodput"],
        "max_fixed_goodput": best_fixed["goodput"],
        "max_fixed": f"{best_fixed['strategy']} {best_fixed['instances']}",
        "chosen_goodput_ge_max_fixed": chosen["goodput"] >= best_fixed["goodput"],
        "measured": {r["strategy"]: r["goodput"] for r in rows},
        "predicted": {r["strategy"]: r["predicted_goodput"] for r in rows},
        "alternative": {
            "cores": alternative["cores"],
            "choice": f"{alt['strategy']} {alt['counts']}",
            "goodput": alt_row["goodput"] if alt_row else None,  # None: that split was not run
        },
    }


if __name__ == "__main__":
    main()
