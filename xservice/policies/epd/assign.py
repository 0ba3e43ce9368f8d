"""From an EPD profile to a deployment: each instance's role and its engine budgets (pure, no I/O).

``cluster.epd.strategy: auto`` (``xservice/cluster/epd/auto.py``) profiles at start-up; this turns
the profiler's report (``xservice/cluster/epd/profiler.py``) into an ``EPDDeployment``:

- the cluster strategy: the chosen one, ``none`` when colocated EPD won;
- the roles: the instances, in config order, split into the chosen pools in the strategy's pool
  order (E+P+D: the first ``E`` instances encode, the next ``P`` prefill, the rest decode);
- Algorithm 1's budgets measured at the chosen deployment's decode batch, as engine overrides, on
  the instances whose steps carry decodes (the budgets keep those steps under the TPOT SLO):
  τ_e (``scheduler.max_encode_images`` / ``max_encode_tokens``) on every instance that encodes and
  decodes, τ_t (``scheduler.max_num_batched_tokens``) on every instance that prefills and decodes.
  An instance without decodes (``encode``, ``prefill``, ``encode_prefill``) keeps its configured
  batch limits: a budget there protects no TPOT and only adds steps, which the goodput model does
  not price (its non-decode pools batch freely; the cluster simulator,
  ``benchmarks/cluster_sim/epd.py``, showed such deployments missing the TTFT SLO by far at the
  rate the model chose). τ_t is kept out when it is 0 (the decodes alone miss the TPOT SLO: a budget
  of 1 would starve the instance) and when chunked prefill is off (a prompt over the budget would
  never be admitted); ``notes`` says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from xengine.api.config import EngineConfig

POOL_ROLES = {
    "E": "encode",
    "P": "prefill",
    "D": "decode",
    "EP": "encode_prefill",
    "ED": "encode_decode",
    "EPD": "mixed",
}
ENCODE_ROLES = frozenset({"encode", "encode_prefill", "encode_decode", "mixed"})
PREFILL_ROLES = frozenset({"prefill", "encode_prefill", "mixed"})
DECODE_ROLES = frozenset({"decode", "encode_decode", "mixed"})
COLOCATED = "EPD"  # the profiler's name of the baseline; the cluster's is "none"


def cluster_strategy(policy_name: str) -> str:
    """The ``cluster.epd.strategy`` of a profiler strategy (``EPD`` -> ``none``)."""
    return "none" if policy_name == COLOCATED else policy_name


def policy_strategies(cluster_names: Sequence[str]) -> tuple[str, ...]:
    """The profiler's names of ``cluster.epd.strategy`` values (``none`` -> ``EPD``)."""
    return tuple(COLOCATED if name == "none" else name for name in cluster_names)


@dataclass(frozen=True)
class EPDDeployment:
    strategy: str  # cluster.epd.strategy: none, E+P+D, EP+D or ED+P
    roles: dict[str, str]  # instance name -> role, in config order
    overrides: dict[str, dict[str, int]]  # instance name -> scheduler field -> value
    notes: list[str] = field(default_factory=list)  # budgets not applied, and why

    def instances(self) -> str:
        """``cluster.launch.instances`` with the roles: ``name:role,...``."""
        return ",".join(f"{name}:{role}" for name, role in self.roles.items())


def plan_deployment(
    report: Mapping[str, Any], names: Sequence[str], chunked_prefill: bool = True
) -> EPDDeployment:
    """The deployment of ``report["choice"]`` over the instances ``names`` (as many as it counts)."""
    choice = report["choice"]
    counts: dict[str, int] = dict(choice["counts"])
    if sum(counts.values()) != len(names):
        raise ValueError(
            f"the profile chose {sum(counts.values())} instance(s) ({choice['strategy']}), "
            f"the cluster lists {len(names)}"
        )
    roles: dict[str, str] = {}
    rest = list(names)
    for pool, count in counts.items():
        roles.update((name, POOL_ROLES[pool]) for name in rest[:count])
        rest = rest[count:]
    roles = {name: roles[name] for name in names}
    measured = report["budgets"]["measured"]
    encode = {
        "max_encode_images": int(measured["config"]["scheduler.max_encode_images"]),
        "max_encode_tokens": int(measured["config"]["scheduler.max_encode_tokens"]),
    }
    tau_t = int(measured["tau_t"])
    notes = []
    prefill: dict[str, int] = {}
    if tau_t > 0 and chunked_prefill:
        prefill = {"max_num_batched_tokens": tau_t}
    elif any(role in PREFILL_ROLES and role in DECODE_ROLES for role in roles.values()):
        why = "is 0 (the decodes alone miss the TPOT SLO)" if tau_t <= 0 else "needs chunked prefill"
        notes.append(f"token budget τ_t {why}: scheduler.max_num_batched_tokens kept as configured")
    overrides = {
        name: {
            **(encode if role in ENCODE_ROLES else {}),
            **(prefill if role in PREFILL_ROLES else {}),
        }
        if role in DECODE_ROLES
        else {}
        for name, role in roles.items()
    }
    return EPDDeployment(cluster_strategy(choice["strategy"]), roles, overrides, notes)


def engine_for(engine: EngineConfig, overrides: Mapping[str, int]) -> EngineConfig:
    """``engine`` with the scheduler fields of ``overrides`` set."""
    if not overrides:
        return engine
    return dataclasses.replace(engine, scheduler=dataclasses.replace(engine.scheduler, **overrides))


def goodput_by_strategy(report: Mapping[str, Any]) -> dict[str, float]:
    """Each strategy's best predicted goodput (requests/s) over its splits, by cluster name, best first."""
    out: dict[str, float] = {}
    for row in report["strategies"]:  # best first
        out.setdefault(cluster_strategy(row["strategy"]), float(row["goodput"]))
    return out
