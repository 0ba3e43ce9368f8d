"""``python -m benchmarks.cluster_sim``: a trace through simulated instances of a device profile, placed by
the service's own policies -- colocated, every static P/D split (or an even sample of them), and
dynamic PD -- and the results as JSON.

    python -m benchmarks.cluster_sim --instances 64 --requests 100000 --trace shifting
    python -m benchmarks.cluster_sim --instances 500 --requests 1000000 --trace bursty --splits 5
    python -m benchmarks.cluster_sim --instances 4 --replay trace.jsonl   # a run the service recorded
    python -m benchmarks.cluster_sim --instances 64 --trace steady --prefix-groups 200 --prefix-tokens 2048

``--replay FILE`` plays a trace the service recorded (``service.record_trace``: arrival, prompt and
output tokens of every finished request) instead of a generated one, and reports the recorded TTFT
and TPOT percentiles beside the simulated ones (``recorded``).

``--prefix-groups G --prefix-tokens T`` give every prompt one of G shared prefixes of T tokens (Zipf
popularity, ``--prefix-zipf``): the instances cache them, colocated placement is the service's
``--routing`` policy (default ``cache_aware``; ``least_load`` to compare) and dynamic PD sees each
instance's uncached tokens; each result reports its ``prefix_hit_rate``.

``--offline-share F`` marks that share of the requests offline (no latency SLO): the P/D configurations
co-locate them with the service's ``ColocationPolicy`` (``benchmarks/cluster_sim/colocation.py``;
``--no-colocation`` places them like online ones), SLO attainment and goodput count the online requests,
and each result's ``offline`` block reports the offline throughput.

``--rate`` defaults to 70% of what the instances can serve by the profile (a steady mix at 32
sequences per decode step); ``--profile`` to ``profiles/illustrative-accelerator.json`` (illustrative,
not a measured device: measure one with ``xllm profile engine``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.cluster_sim.cluster import Cluster, SimConfig
from benchmarks.cluster_sim.metrics import summarize
from benchmarks.cluster_sim.trace import TRACES, LengthMix, PrefixMix, SimRequest, make_trace
from benchmarks.smoke import add_smoke_flag, parse_args
from ops.platforms.cpu_features import cpu_features
from ops.platforms.device_profile import DeviceProfile, load_profile
from xservice.policies.routing import POLICIES
from xservice.serving.trace_record import TraceRecord, load_trace

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "illustrative-accelerator.json"


def default_rate(profile: DeviceProfile, instances: int, mix: LengthMix, batch: int = 32) -> float:
    """70% of the requests per second ``instances`` serve of ``mix`` by ``profile``."""
    prompt, out = int(mix.prompt_median), int(mix.output_median)
    prefill = profile.step_seconds([prompt], [prompt])
    decode = profile.step_seconds([1] * batch, [prompt + out // 2] * batch) / batch
    return 0.7 * instances / (prefill + out * decode)


def splits(instances: int, count: int) -> list[int]:
    """Prefill instance counts to try: all of 1..N-1, or ``count`` evenly spread."""
    if instances - 1 <= count:
        return list(range(1, instances))
    return sorted(
        {max(1, min(instances - 1, round(instances * (k + 1) / (count + 1)))) for k in range(count)}
    )


def replayed(records: list[TraceRecord]) -> list[SimRequest]:
    """A recorded trace as simulator requests, arrivals from the first one's."""
    if not records:
        raise SystemExit("--replay: the trace has no records")
    t0 = records[0].arrival
    return [
        SimRequest(i, r.arrival - t0, max(1, r.prompt_tokens), max(1, r.output_tokens))
        for i, r in enumerate(records)
    ]


def recorded_latency(records: list[TraceRecord]) -> dict:
    def pcts(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return {"p50": round(float(p50), 4), "p90": round(float(p90), 4), "p99": round(float(p99), 4)}

    return {
        "ttft_s": pcts([r.ttft_s for r in records if r.ttft_s is not None]),
        "tpot_s": pcts([r.tpot_s for r in records if r.tpot_s is not None]),
    }


def run_one(config: SimConfig, profile: DeviceProfile, trace) -> dict:
    cluster = Cluster(config, profile)
    records = cluster.run(trace)
    return summarize(records, cluster)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--trace", choices=TRACES, default="shifting")
    ap.add_argument("--rate", type=float, help="requests per second (default: 70%% of capacity)")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE))
    ap.add_argument("--prompt-median", type=float, default=1024)
    ap.add_argument("--output-median", type=float, default=256)
    ap.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--splits", type=int, default=7, help="static splits tried (evenly spread; all if fewer)")
    ap.add_argument("--modes", default="colocated,static,dynamic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", metavar="FILE", help="a trace the service recorded (service.record_trace)")
    ap.add_argument("--prefix-groups", type=int, default=0, help="shared prompt prefixes (0: none)")
    ap.add_argument("--prefix-tokens", type=int, default=1024, help="each shared prefix's length")
    ap.add_argument("--prefix-zipf", type=float, default=1.0, help="popularity exponent of the prefixes")
    ap.add_argument("--routing", choices=POLICIES, default="cache_aware", help="colocated placement")
    ap.add_argument("--offline-share", type=float, default=0.0, help="share of the requests offline (batch)")
    ap.add_argument(
        "--no-colocation",
        action="store_true",
        help="place offline requests like online ones in the P/D configurations (default: co-locate them)",
    )
    add_smoke_flag(ap)
    args = parse_args(ap, argv, {"instances": 4, "requests": 300, "splits": 2})
    profile = load_profile(args.profile)
    mix = LengthMix(args.prompt_median, args.output_median)
    shared = args.prefix_tokens if args.prefix_groups else 0  # the default rate prices prompts uncached
    rate = args.rate or default_rate(
        profile, args.instances, LengthMix(args.prompt_median + shared, args.output_median)
    )
    t0 = time.perf_counter()
    recorded = load_trace(args.replay) if args.replay else None
    if recorded is not None:
        trace = replayed(recorded)
        args.requests = len(trace)
        rate = len(trace) / max(trace[-1].arrival, 1e-9)
    else:
        prefix = (
            PrefixMix(args.prefix_groups, args.prefix_tokens, args.prefix_zipf)
            if args.prefix_groups
            else None
        )
        trace = make_trace(
            args.trace, args.requests, rate, args.seed, mix, prefix=prefix, offline_share=args.offline_share
        )
    base = dict(
        num_instances=args.instances,
        ttft_slo_s=args.ttft_slo_ms / 1000,
        tpot_slo_s=args.tpot_slo_ms / 1000,
        routing=args.routing,
    )
    # P/D configurations co-locate offline requests (ColocationPolicy) when the trace has some
    pd = dict(colocation=any(r.offline for r in trace) and not args.no_colocation)
    modes = set(args.modes.split(","))
    out: dict = {
        "instances": args.instances,
        "trace": args.trace,
        "rate": round(rate, 3),
        "profile": profile.name,
        "routing": args.routing,
        "prefix": {"groups": args.prefix_groups, "tokens": args.prefix_tokens, "zipf": args.prefix_zipf}
        if args.prefix_groups
        else None,
        "slo_ms": {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms},
        "offline_share": args.offline_share,
        "colocation": pd["colocation"],
        "host_cpu": cpu_features().model_name,
    }
    if recorded is not None:
        out["trace"] = f"replay of {args.replay}"
        out["recorded"] = recorded_latency(recorded)
    if "colocated" in modes:
        out["colocated"] = run_one(SimConfig("colocated", **base), profile, trace)
        print(f"[sim] colocated: {out['colocated']['slo_attainment']:.3f}", file=sys.stderr, flush=True)
    if "static" in modes:
        out["static"] = []
        for p in splits(args.instances, args.splits):
            result = run_one(SimConfig("static", num_prefill=p, **base, **pd), profile, trace)
            out["static"].append({"num_prefill": p, "num_decode": args.instances - p, **result})
            print(
                f"[sim] static {p}P/{args.instances - p}D: {result['slo_attainment']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        best = max(out["static"], key=lambda r: (r["slo_attainment"], r["goodput"]))
        out["best_static"] = {k: best[k] for k in ("num_prefill", "slo_attainment", "goodput")}
    if "dynamic" in modes:
        start_p = max(1, args.instances // 2)
        out["dynamic"] = run_one(SimConfig("dynamic", num_prefill=start_p, **base, **pd), profile, trace)
        print(f"[sim] dynamic: {out['dynamic']['slo_attainment']:.3f}", file=sys.stderr, flush=True)
    out["simulated_requests"] = args.requests * (
        ("colocated" in modes) + len(out.get("static", [])) + ("dynamic" in modes)
    )
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
