"""Prefill-as-a-Service: the throughput model against the paper, and the simulator on the same setups.

    python -m benchmarks.prfaas --paper            # Table 6 from Table 5's profiles, side by side (JSON)
    python -m benchmarks.prfaas --paper --sim      # ... and the three deployments simulated
    python -m benchmarks.prfaas --profile P.json   # a profile measured here (``xllm profile engine``)
    python -m benchmarks.prfaas --smoke

``--paper``: the grid search (``xservice/policies/prfaas``) over the paper's inputs -- Table 5's H200
prefill rows, the H20 rows derived from Table 6's two H20 prefill points (the paper prints no H20
profile; ``benchmarks/cluster_sim/profiles/prfaas/h20x8-paper-derived.json`` says how), the log-normal
lengths, 1024 output tokens, the 40 tok/s SLO, a 100 Gbps link -- for PrfaaS-PD (4 PrfaaS + 8 local),
homogeneous PD (12 local) and naive heterogeneous PD (4 + 8), beside the published values and the
relative deviation of each.

``--sim``: each deployment in ``benchmarks/cluster_sim/prfaas.py``: its capacity at the planned
operating point (every request arriving at 1.5x the model's ``Lambda_max``: requests over the makespan), its TTFT at one common rate (85% of the
simulated homogeneous capacity), and PrfaaS-PD with the link cut to ``--cut-gbps`` halfway through, at
70% of what its split sustains over the cut link, with and without the bandwidth-aware scheduler (the
link's backlog, the thresholds it moved to).

``--profile``: the same three deployments with a device profile measured on this machine for the local
instances and that profile ``--prfaas-speedup`` times faster for the PrfaaS ones (the compute asymmetry
the emulated instances make real), over log-normal lengths fitted to the profile's range.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import replace
from typing import Any

from benchmarks.cluster_sim.prfaas import PrfaasCluster, PrfaasSimConfig, lognormal_trace
from benchmarks.prfaas import paper
from xservice.policies.prfaas import (
    LogNormalLengths,
    decode_rate,
    plan,
    plan_homogeneous,
    plan_naive,
    prefill_curve,
)
from xservice.policies.prfaas.model import OperatingPoint, Stages

NAMES = ("prfaas_pd", "homogeneous_pd", "naive_heterogeneous")


def _plans(
    stages: Stages, lengths, out: int, prfaas: int, local: int, homogeneous: int
) -> dict[str, OperatingPoint]:
    return {
        "prfaas_pd": plan(stages, lengths, out, prfaas, local),
        "homogeneous_pd": plan_homogeneous(stages, lengths, out, homogeneous),
        "naive_heterogeneous": plan_naive(stages, lengths, out, prfaas, local),
    }


def _simulate(
    points: dict[str, OperatingPoint], stages: Stages, lengths, out: int, n: int, seed: int, cut_gbps: float
) -> dict[str, Any]:
    res: dict[str, Any] = {"num_requests": n}
    configs = {}
    for name, pt in points.items():
        d = pt.deployment
        configs[name] = PrfaasSimConfig(
            d.prfaas, d.prefill, d.decode, d.threshold, out, link_gbps=stages.bandwidth_gbps
        )
        # capacity at the planned operating point (the scheduler would move it off the model's point)
        static = replace(configs[name], scheduler=False)
        cap = PrfaasCluster(static, stages, lengths).run(
            lognormal_trace(lengths, n, 1.5 * pt.lambda_max, out, seed)
        )
        res[name] = {
            "capacity_req_s": cap["throughput_req_s"],
            "model_lambda_max_req_s": round(pt.lambda_max, 4),
        }
    base = res["homogeneous_pd"]["capacity_req_s"]
    common = 0.85 * base  # a load every deployment sustains
    res["common_rate_req_s"] = round(common, 4)
    for name in NAMES:
        res[name]["capacity_vs_homogeneous"] = round(res[name]["capacity_req_s"] / base, 3) if base else None
        lat = PrfaasCluster(configs[name], stages, lengths).run(
            lognormal_trace(lengths, n, common, out, seed)
        )
        keys = ("ttft_s", "offload_fraction", "egress_gbps_mean", "prefill_utilization")
        res[name]["at_common_rate"] = {k: lat[k] for k in keys}
    res["link_cut"] = _link_cut(points["prfaas_pd"], stages, lengths, out, n, seed, cut_gbps)
    return res


def _link_cut(
    pt: OperatingPoint, stages: Stages, lengths, out: int, n: int, seed: int, cut_gbps: float
) -> dict[str, Any]:
    """PrfaaS-PD at 70% of what its split sustains over the cut link, the link cut halfway through: the
    scheduler raises t (short term) and re-searches it (long term); without it the link's backlog grows."""
    d = pt.deployment
    cut_stages = replace(stages, bandwidth_gbps=cut_gbps)
    rate = 0.7 * plan(cut_stages, lengths, out, d.prfaas, d.prefill + d.decode, splits=[d.prefill]).lambda_max
    trace = lognormal_trace(lengths, n, rate, out, seed + 1)
    half = trace[len(trace) // 2].arrival
    res: dict[str, Any] = {
        "rate_req_s": round(rate, 4),
        "link_gbps": [stages.bandwidth_gbps, cut_gbps],
        "cut_at_s": round(half, 1),
    }
    for label, on in (("with_scheduler", True), ("without_scheduler", False)):
        cfg = PrfaasSimConfig(
            d.prfaas, d.prefill, d.decode, d.threshold, out, link_gbps=stages.bandwidth_gbps,
            scheduler=on, link_schedule=((half, cut_gbps),),
        )  # fmt: skip
        r = PrfaasCluster(cfg, stages, lengths).run(trace)
        after = [s for s in r["trajectory"] if s["at_s"] >= half]
        res[label] = {
            "threshold_final": r["threshold_final"],
            "link_backlog_s_max_after_cut": round(max((s["queue_s"] for s in after), default=0.0), 3),
            "ttft_s": r["ttft_s"],
            "throughput_req_s": r["throughput_req_s"],
            "offload_fraction": r["offload_fraction"],
            "threshold_changes": [s for s in r["trajectory"] if s["reason"] != "hold"][:12],
        }
    return res


def _measured(args: argparse.Namespace) -> dict[str, Any]:
    data = json.loads(open(args.profile).read())
    lengths = LogNormalLengths(math.log(args.median_tokens), 1.0, 16, args.max_tokens)
    local = prefill_curve(data, chunk=args.chunk or None)
    fast = prefill_curve(data, chunk=args.chunk or None, speedup=args.prfaas_speedup)
    context = lengths.mean() + args.output_tokens / 2
    dec = decode_rate(data, slo_tokens_per_s=args.slo_tokens_per_s, context_tokens=context)
    stages = Stages(local=local, decode=dec, prfaas=fast, bandwidth_gbps=args.link_gbps, service="mean")
    return {"stages": stages, "lengths": lengths}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prfaas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--paper", action="store_true", help="the paper's case study (Table 6)")
    ap.add_argument(
        "--profile", metavar="JSON", help="a device profile measured here, for the local instances"
    )
    ap.add_argument("--sim", action="store_true", help="also simulate the three deployments")
    ap.add_argument("--smoke", action="store_true", help="the paper's model and a short simulation (seconds)")
    ap.add_argument("--requests", type=int, default=3000, help="requests per simulated run (default 3000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cut-gbps", type=float, help="the link's capacity after the cut (default: paper 4, profile 1/4)"
    )
    ap.add_argument(
        "--prfaas-speedup", type=float, default=4.0, help="--profile: PrfaaS instances this much faster"
    )
    ap.add_argument("--prfaas-instances", type=int, default=2)
    ap.add_argument("--local-instances", type=int, default=4)
    ap.add_argument("--median-tokens", type=float, default=600.0, help="--profile: median prompt length")
    ap.add_argument("--max-tokens", type=int, default=2048, help="--profile: longest prompt")
    ap.add_argument("--output-tokens", type=int, default=64, help="--profile: output tokens")
    ap.add_argument("--slo-tokens-per-s", type=float, default=10.0, help="--profile: decode stream SLO")
    ap.add_argument(
        "--chunk", type=int, default=0, help="--profile: prefill chunk (default: a prompt in one step)"
    )
    ap.add_argument("--link-gbps", type=float, default=1.0, help="--profile: the PrfaaS link")
    args = ap.parse_args(argv)
    if not (args.paper or args.profile or args.smoke):
        ap.error("give --paper, --profile JSON or --smoke")
    started = time.time()
    report: dict[str, Any] = {
        "benchmark": "prfaas",
        "host": {"cpu": platform.processor() or platform.machine()},
    }
    if args.smoke:
        args.paper, args.sim, args.requests = True, True, min(args.requests, 300)
    if args.paper:
        st = paper.stages()
        points = _plans(
            st,
            paper.LENGTHS,
            paper.OUTPUT_TOKENS,
            paper.PRFAAS_INSTANCES,
            paper.LOCAL_INSTANCES,
            paper.HOMOGENEOUS_INSTANCES,
        )
        ours = {k: v.to_dict() for k, v in points.items()}
        report["model"] = ours
        report["paper"] = paper.PAPER
        devs = {k: paper.deviations(ours[k], paper.PAPER[k]) for k in NAMES}
        report["deviation"] = devs
        report["within_5pct"] = all(abs(v) <= 0.05 for d in devs.values() for v in d.values())
        report["ratio_vs_homogeneous"] = {
            k: round(points[k].lambda_max / points["homogeneous_pd"].lambda_max, 3) for k in NAMES
        }
        # the same search with each stage's mean service time instead of the paper's representative length
        mean = _plans(
            replace(st, service="mean"),
            paper.LENGTHS,
            paper.OUTPUT_TOKENS,
            paper.PRFAAS_INSTANCES,
            paper.LOCAL_INSTANCES,
            paper.HOMOGENEOUS_INSTANCES,
        )
        report["model_mean_service"] = {
            k: {kk: v.to_dict()[kk] for kk in ("threshold_tokens", "instances", "lambda_max_req_s")}
            for k, v in mean.items()
        }
        if args.sim:
            report["sim"] = _simulate(
                points, st, paper.LENGTHS, paper.OUTPUT_TOKENS, args.requests, args.seed, args.cut_gbps or 4.0
            )
    if args.profile:
        m = _measured(args)
        st, lengths = m["stages"], m["lengths"]
        n_p, n_l = args.prfaas_instances, args.local_instances
        points = _plans(st, lengths, args.output_tokens, n_p, n_l, n_p + n_l)
        report["measured"] = {
            "profile": args.profile,
            "prfaas_speedup": args.prfaas_speedup,
            "lengths": {
                "median": args.median_tokens,
                "sigma": 1.0,
                "max": args.max_tokens,
                "mean": round(lengths.mean()),
            },
            "decode": {"max_batch": st.decode.max_batch, "step_s": round(st.decode.step_s, 5)},
            "model": {
                k: {kk: vv for kk, vv in v.to_dict().items() if kk != "search"} for k, v in points.items()
            },
            "sim": _simulate(
                points,
                st,
                lengths,
                args.output_tokens,
                args.requests,
                args.seed,
                args.cut_gbps or args.link_gbps / 4,
            ),
        }
    report["wall_s"] = round(time.time() - started, 1)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
