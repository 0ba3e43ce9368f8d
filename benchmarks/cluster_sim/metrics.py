"""What a simulated run reports: SLO attainment, goodput, TTFT / TPOT percentiles, utilisation, prefix hits,
offline throughput."""

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
    """The online requests' SLO attainment, goodput and latency (every request on a trace without
    offline ones), and the offline requests' throughput apart (``offline``, when the trace has some)."""
    online = [r for r in records.values() if not r.req.offline]
    offline = [r for r in records.values() if r.req.offline]
    out = _latency(online, cluster) if online else {}
    if offline:
        done = [r for r in offline if r.end is not None]
        start = min(r.req.arrival for r in offline)
        span = max((r.end for r in done), default=start) - start
        tokens = sum(r.req.output for r in done)
        out["offline"] = {
            "num_requests": len(offline),
            "num_unfinished": len(offline) - len(done),
            "throughput": round(len(done) / span, 3) if span > 0 else 0.0,
            "output_tokens_per_s": round(tokens / span, 1) if span > 0 else 0.0,
            **(cluster.coloc.counts if cluster.coloc is not None else {}),
        }
    return out


def _latency(recs: list[RequestRecord], cluster: Cluster) -> dict[str, Any]:
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
    prompt = sum(i.prompt_tokens for i in cluster.instances)
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
        # prompt tokens the prefill instances' prefix caches held (0 on a trace without shared prefixes)
        "prefix_hit_rate": round(sum(i.hit_tokens for i in cluster.instances) / prompt, 4) if prompt else 0.0,
        "span_s": round(span, 3),
    }
