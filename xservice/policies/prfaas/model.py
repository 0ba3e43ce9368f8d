"""The PrfaaS-PD throughput model (paper section 3.4.1) and its grid search (section 4.2).

A request whose uncached length ``L`` exceeds the threshold ``t`` prefills on the PrfaaS cluster (share
``p = P(L > t)``, represented by ``l_long = E[L | L > t]``), the rest on the local cluster's prefill
instances (``l_short = E[L | L <= t]``); every request decodes locally. Per stage, in requests/s:

    Theta_prfaas = min(N_prfaas / T_prfaas(l_long), B_out / S_kv(l_long))      (3)
    Theta_pd_p   = N_p / T_local(l_short)                                        (4)
    Theta_pd_d   = N_d * BS_max / (T_decode * L_out)                             (5)
    Lambda_max   = min(Theta_prfaas / p, Theta_pd_p / (1 - p), Theta_pd_d)       (6)

``plan`` maximises ``Lambda_max`` over ``t`` and the split ``N_p + N_d`` of the local instances: for each
split the best ``t`` is where the two prefill terms cross (equation 7: one rises with ``t``, the other
falls), found by bisection; the split with the highest ``Lambda_max`` wins (its decode term balancing
the prefill ones, equation 8). ``plan_homogeneous`` is the local cluster alone (``p = 0``) over its
splits, ``plan_naive`` every prefill on PrfaaS (``p = 1``) and every local instance decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from xservice.policies.prfaas.lengths import LengthDistribution
from xservice.policies.prfaas.profiles import DecodeRate, PrefillCurve


@dataclass(frozen=True)
class Deployment:
    prfaas: int  # N_prfaas: PrfaaS prefill instances
    prefill: int  # N_p: the local cluster's prefill instances
    decode: int  # N_d: its decode instances
    threshold: float  # t: uncached lengths above it prefill on PrfaaS (inf: none do; 0: all do)


@dataclass(frozen=True)
class Stages:
    """What the model is given about the hardware: each cluster's prefill curve, the decode rate under the
    SLO, and the PrfaaS cluster's egress bandwidth ``B_out``."""

    local: PrefillCurve
    decode: DecodeRate
    prfaas: PrefillCurve | None = None
    bandwidth_gbps: float = math.inf
    # "representative": the paper's T_prefill(E[L | ...]); "mean": E[T_prefill(L) | ...], which a
    # convex latency curve (a long prompt costs more than its share) needs to match what is served
    service: str = "representative"

    def __post_init__(self) -> None:
        if self.service not in ("representative", "mean"):
            raise ValueError("service must be 'representative' (the paper's) or 'mean'")


@dataclass(frozen=True)
class OperatingPoint:
    deployment: Deployment
    p: float  # share of requests offloaded to PrfaaS
    l_long: float
    l_short: float
    theta_prfaas: float | None  # requests/s of each stage (None: the stage is absent)
    theta_pd_p: float | None
    theta_pd_d: float
    lambda_max: float  # requests/s the whole system sustains
    bottleneck: str  # "prfaas-compute", "prfaas-bandwidth", "pd-p" or "pd-d"
    egress_gbps: float  # the PrfaaS cluster's egress at lambda_max
    ceiling_req_s: float | None  # B_out / S_kv(l_long): the link's ceiling on offloaded requests/s
    search: dict[str, Any] = field(default_factory=dict, compare=False)  # the grid, for plots

    def to_dict(self) -> dict[str, Any]:
        d = self.deployment
        routed = d.prfaas > 0 and d.prefill > 0  # length routing between two prefill pools
        r = lambda v: None if v is None else round(v, 4)  # noqa: E731
        out = {
            "threshold_tokens": round(d.threshold) if routed else None,
            "instances": {
                "prfaas": d.prfaas or None,
                "prefill": d.prefill or None,
                "decode": d.decode,
            },
            "throughput": {
                "prfaas": r(self.theta_prfaas),
                "pd_p": r(self.theta_pd_p),
                "pd_d": r(self.theta_pd_d),
            },
            "lambda_max_req_s": r(self.lambda_max),
            "bottleneck": self.bottleneck,
            "offload_fraction": r(self.p),
            "l_long_tokens": round(self.l_long) if self.p > 0 else None,
            "l_short_tokens": round(self.l_short) if self.p < 1 else None,
            "egress_gbps": r(self.egress_gbps),
            "bandwidth_ceiling_req_s": r(self.ceiling_req_s),
        }
        if self.search:
            out["search"] = self.search
        return out


def evaluate(
    deployment: Deployment, stages: Stages, lengths: LengthDistribution, output_tokens: float
) -> OperatingPoint:
    """Equations 3-6 at one deployment."""
    d = deployment
    split = lengths.split(d.threshold)
    p = split.p if d.threshold > 0 else 1.0
    l_long = split.l_long if d.threshold > 0 else lengths.mean()
    l_short = split.l_short
    theta_d = stages.decode.requests_per_s(d.decode, output_tokens)
    terms = {"pd-d": theta_d}
    theta_f = theta_p = None
    ceiling = None
    egress_per_req = 0.0
    mean = stages.service == "mean"
    if d.prfaas and p > 0:
        curve = stages.prfaas
        if curve is None:
            raise ValueError("a deployment with PrfaaS instances needs the PrfaaS prefill curve")
        t_long = lengths.expect(curve.prefill_s, d.threshold, True) if mean else curve.prefill_s(l_long)
        s_long = lengths.expect(curve.kv_size, d.threshold, True) if mean else curve.kv_size(l_long)
        compute = d.prfaas / t_long
        egress_per_req = s_long * 8 / 1e9  # Gbit
        ceiling = stages.bandwidth_gbps / egress_per_req if egress_per_req else math.inf
        theta_f = min(compute, ceiling)
        terms["prfaas-compute" if compute <= ceiling else "prfaas-bandwidth"] = theta_f / p
    elif p > 0:
        terms["prfaas-compute"] = 0.0  # requests above t and nowhere to prefill them
    if d.prefill and p < 1:
        local = stages.local
        theta_p = d.prefill / (
            lengths.expect(local.prefill_s, d.threshold, False) if mean else local.prefill_s(l_short)
        )
        terms["pd-p"] = theta_p / (1 - p)
    elif p < 1:
        terms["pd-p"] = 0.0
    bottleneck = min(terms, key=lambda k: terms[k])
    lam = terms[bottleneck]
    return OperatingPoint(
        d, p, l_long, l_short, theta_f, theta_p, theta_d, lam, bottleneck, lam * p * egress_per_req, ceiling
    )


def _crossing(
    prfaas: int, prefill: int, decode: int, stages: Stages, lengths: LengthDistribution, out: float
) -> OperatingPoint:
    """The threshold where the PrfaaS and local-prefill terms of equation 6 meet (equation 7)."""
    lo, hi = math.log(max(lengths.lo, 1.0)), math.log(lengths.hi)

    def point(log_t: float) -> OperatingPoint:
        return evaluate(Deployment(prfaas, prefill, decode, math.exp(log_t)), stages, lengths, out)

    def gap(pt: OperatingPoint) -> float:
        a = pt.theta_prfaas / pt.p if pt.p > 0 and pt.theta_prfaas is not None else math.inf
        b = pt.theta_pd_p / (1 - pt.p) if pt.p < 1 and pt.theta_pd_p is not None else math.inf
        return a - b

    for _ in range(60):
        mid = (lo + hi) / 2
        if gap(point(mid)) < 0:
            lo = mid
        else:
            hi = mid
    return point((lo + hi) / 2)


def plan(
    stages: Stages,
    lengths: LengthDistribution,
    output_tokens: float,
    prfaas_instances: int,
    local_instances: int,
    *,
    splits: list[int] | None = None,
    curve_points: int = 24,
) -> OperatingPoint:
    """The best PrfaaS-PD deployment: threshold and local split maximising ``Lambda_max``. Its ``search``
    holds the paper's figure 5: ``Lambda_max`` over the splits at the best threshold (a), and both prefill
    terms over thresholds at the best split (b). ``splits``: the local prefill counts to consider (default
    every one from 1 to ``local_instances - 1``)."""
    if prfaas_instances < 1 or local_instances < 2:
        raise ValueError(
            "PrfaaS-PD needs at least 1 PrfaaS instance and 2 local ones (a prefill and a decode)"
        )
    if stages.prfaas is None:
        raise ValueError("PrfaaS-PD needs the PrfaaS cluster's prefill curve")
    if not math.isfinite(lengths.hi):
        raise ValueError("the length distribution needs a finite longest length (hi) to search thresholds in")
    if splits is not None and (not splits or not all(0 < n < local_instances for n in splits)):
        raise ValueError(f"local prefill counts must lie in 1..{local_instances - 1}")
    candidates = [
        _crossing(prfaas_instances, n_p, local_instances - n_p, stages, lengths, output_tokens)
        for n_p in (splits or range(1, local_instances))
    ]
    best = max(candidates, key=lambda pt: (round(pt.lambda_max, 9), -pt.deployment.prefill))
    d = best.deployment
    by_split = [
        evaluate(
            Deployment(d.prfaas, n_p, local_instances - n_p, d.threshold), stages, lengths, output_tokens
        )
        for n_p in range(1, local_instances)
    ]
    lo, hi = math.log(max(lengths.lo, 1.0)), math.log(lengths.hi)
    grid = [math.exp(lo + (hi - lo) * k / (curve_points - 1)) for k in range(curve_points)]
    by_t = [
        evaluate(Deployment(d.prfaas, d.prefill, d.decode, t), stages, lengths, output_tokens) for t in grid
    ]
    search = {
        "by_split_at_threshold": [
            {
                "prefill": pt.deployment.prefill,
                "decode": pt.deployment.decode,
                "lambda_max_req_s": round(pt.lambda_max, 4),
            }
            for pt in by_split
        ],
        "by_threshold_at_split": [
            {
                "threshold_tokens": round(pt.deployment.threshold),
                "offload_fraction": round(pt.p, 4),
                "prfaas_term_req_s": round(pt.theta_prfaas / pt.p, 4)
                if pt.p > 0 and pt.theta_prfaas
                else None,
                "pd_p_term_req_s": round(pt.theta_pd_p / (1 - pt.p), 4)
                if pt.p < 1 and pt.theta_pd_p
                else None,
            }
            for pt in by_t
        ],
    }
    return OperatingPoint(**{**best.__dict__, "search": search})


def plan_homogeneous(
    stages: Stages, lengths: LengthDistribution, output_tokens: float, instances: int
) -> OperatingPoint:
    """The local cluster alone: every prefill local, the split with the highest ``Lambda_max``."""
    if instances < 2:
        raise ValueError("a PD cluster needs at least 2 instances")
    points = [
        evaluate(Deployment(0, n_p, instances - n_p, math.inf), stages, lengths, output_tokens)
        for n_p in range(1, instances)
    ]
    return max(points, key=lambda pt: (round(pt.lambda_max, 9), -pt.deployment.prefill))


def plan_naive(
    stages: Stages,
    lengths: LengthDistribution,
    output_tokens: float,
    prfaas_instances: int,
    local_instances: int,
) -> OperatingPoint:
    """Naive heterogeneous PD: every prefill on the PrfaaS cluster, every local instance decoding."""
    return evaluate(Deployment(prfaas_instances, 0, local_instances, 0.0), stages, lengths, output_tokens)
