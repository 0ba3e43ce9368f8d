"""What a simulated run reports: SLO attainment, goodput, TTFT / TPOT percentiles, utilisation."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.cluster_sim.cluster import Cluster, RequestRecord


def _pct(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p50), 4), "p90": round(float(p90), 4), "p99": round(float(p99), 4)}


def summarize(records: dict[int, RequestRecord], cluster: Cluster) -> dict[str, Any]:
    recs = list(records.values())
    done = [r for r in recs if r.end is not None and r.first_token is not None]
    ttft = np.array([r.first_token - r.req.arrival for r in done])
    multi = [r for r in done if r.req.output > 1]
    tpot = np.array([(r.end - r.first_token) / (r.req.output - 1) for r in multi])
    slo = cluster.slo
    tpot_ok = {id(r): (r.end - r.first_token) / (r.req.output - 1) <= slo.tpot_s for r in multi}
    met = sum(1 for r, t in zip(done, ttft) if t <= slo.ttft_s and tpot_ok.get(id(r), True))
    start = min(r.req.arrival for r in recs)
    span = max((r.end for r in done), default=start) - start
    busy = [i.busy_s for i in cluster.instances]
    return {
        "slo_attainment": round(met / len(recs), 4),
        "goodput": round(met / span, 3) if span > 0 else 0.0,  # requests meeting both SLOs per second
        "throughput": round(len(done) / span, 3) if span > 0 else 0.0,
        "num_requests": len(recs),
        "num_unfinished": len(recs) - len(done),
        "ttft_s": _pct(ttft),
        "tpot_s": _pct(tpot),
        "utilization": round(float(np.mean(busy)) / span, 4) if span > 0 else 0.0,
        "num_flips": cluster.num_flips,
        "span_s": round(span, 3),
    }
