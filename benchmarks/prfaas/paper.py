"""The PrfaaS paper's case study (shared/papers/prefill-as-a-service.txt, section 4): its inputs and the
values it publishes (Table 6, section 4.2), and how far a result is from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xservice.policies.prfaas import LogNormalLengths, decode_rate, prefill_curve
from xservice.policies.prfaas.model import Stages

PROFILES = Path(__file__).resolve().parents[1] / "cluster_sim" / "profiles" / "prfaas"
H200 = PROFILES / "h200x8-paper-table5.json"  # Table 5, as printed
H20 = (
    PROFILES / "h20x8-paper-derived.json"
)  # derived from Table 6's two H20 prefill points (see its "source")

LENGTHS = LogNormalLengths(mu=9.90, sigma=1.00, lo=128, hi=131072)  # section 4.1
OUTPUT_TOKENS = 1024
SLO_TOKENS_PER_S = 40.0
LINK_GBPS = 100.0  # the cross-cluster link
PRFAAS_INSTANCES, LOCAL_INSTANCES, HOMOGENEOUS_INSTANCES = 4, 8, 12  # 32 H200, 64 H20, 96 H20 at 8 a piece

PAPER: dict[str, dict[str, Any]] = {
    "prfaas_pd": {
        "threshold_tokens": 19400,
        "instances": {"prfaas": 4, "prefill": 3, "decode": 5},
        "throughput": {"prfaas": 1.61, "pd_p": 1.64, "pd_d": 3.91},
        "lambda_max_req_s": 3.24,
        "ttft_s": {"mean": 2.22, "p90": 3.51},
        "offload_fraction": 0.496,
        "l_long_tokens": 44000,
        "egress_gbps": 13.0,
    },
    "homogeneous_pd": {
        "threshold_tokens": None,
        "instances": {"prfaas": None, "prefill": 9, "decode": 3},
        "throughput": {"prfaas": None, "pd_p": 2.11, "pd_d": 2.35},
        "lambda_max_req_s": 2.11,
        "ttft_s": {"mean": 4.44, "p90": 9.73},
    },
    "naive_heterogeneous": {
        "threshold_tokens": None,
        "instances": {"prfaas": 4, "prefill": None, "decode": 8},
        "throughput": {"prfaas": 2.45, "pd_p": None, "pd_d": 6.25},
        "lambda_max_req_s": 2.45,
        "ttft_s": {"mean": 1.74, "p90": 3.51},
    },
}
CHECKED = ("threshold_tokens", "instances", "throughput", "lambda_max_req_s")  # the "within 5%"


def stages(link_gbps: float = LINK_GBPS) -> Stages:
    h200, h20 = (json.loads(p.read_text()) for p in (H200, H20))
    decode = decode_rate(h20, slo_tokens_per_s=SLO_TOKENS_PER_S, context_tokens=LENGTHS.mean())
    return Stages(
        local=prefill_curve(h20), decode=decode, prfaas=prefill_curve(h200), bandwidth_gbps=link_gbps
    )


def deviations(ours: dict[str, Any], paper: dict[str, Any]) -> dict[str, float]:
    """Relative deviation of each published number ``CHECKED`` (``key.sub``) from ours."""
    out: dict[str, float] = {}

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(b, dict):
            for k, v in b.items():
                walk((a or {}).get(k), v, f"{key}.{k}" if key else k)
        elif b is None:
            if a is not None:
                out[key] = float("inf")
        else:
            out[key] = round((a - b) / b, 4) if a is not None else float("inf")

    for k in CHECKED:
        walk(ours.get(k), paper.get(k), k)
    return out
