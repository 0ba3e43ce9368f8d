"""Prefill-as-a-Service (shared/papers/prefill-as-a-service.txt, section 3.4): pure policies.

- ``profiles``: a stage's prefill latency and KV size by prompt length, a decode instance's rate;
- ``lengths``: the distribution of uncached prompt lengths (the paper's truncated log-normal, or
  measured samples);
- ``model``: the throughput model (equations 3-6) and the grid search over the threshold and the local
  P/D split, with the homogeneous and naive heterogeneous baselines;
- ``routing``: where one request prefills (threshold on its uncached length, cache-aware in both
  bandwidth regimes);
- ``scheduler``: the dual-timescale, bandwidth-aware scheduler (raise the threshold near the link's
  ceiling; re-plan the threshold and the P/D split from what was measured).
"""

from xservice.policies.prfaas.lengths import EmpiricalLengths, LengthDistribution, LogNormalLengths
from xservice.policies.prfaas.model import (
    Deployment,
    OperatingPoint,
    evaluate,
    plan,
    plan_homogeneous,
    plan_naive,
)
from xservice.policies.prfaas.profiles import DecodeRate, PrefillCurve, decode_rate, prefill_curve
from xservice.policies.prfaas.routing import LOCAL, PRFAAS, PrefillRoute, route_prefill
from xservice.policies.prfaas.scheduler import BandwidthAwareScheduler, LinkSample, SchedulerDecision

__all__ = [
    "LOCAL",
    "PRFAAS",
    "BandwidthAwareScheduler",
    "DecodeRate",
    "Deployment",
    "EmpiricalLengths",
    "LengthDistribution",
    "LinkSample",
    "LogNormalLengths",
    "OperatingPoint",
    "PrefillCurve",
    "PrefillRoute",
    "SchedulerDecision",
    "decode_rate",
    "evaluate",
    "plan",
    "plan_homogeneous",
    "plan_naive",
    "prefill_curve",
    "route_prefill",
]
