"""Which EPD strategy and instance counts serve a workload best: an analytical goodput model (pure).

Each pool's mean step grows with the work it carries, Algorithm 1's budgets bound what a decode step
may carry, TTFT sums the first-token path, and goodput is the highest rate where every pool keeps up
and both SLOs hold. The derivation, its terms and what it leaves out: ``docs/multimodal.md``,
"The goodput model".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from xservice.policies.epd.costs import EPDSLO, Budgets, EPDWorkload, StageCosts, budgets

STRATEGIES: dict[str, tuple[str, ...]] = {
    "E+P+D": ("E", "P", "D"),
    "EP+D": ("EP", "D"),
    "ED+P": ("ED", "P"),
    "EPD": ("EPD",),
}
MAX_OVER_SLO_STEP_SHARE = 0.1  # HydraInfer: TPOT is met when 90% of a request's TPOTs are
_BISECT_STEPS = 60
_CONTENTION_STEPS = 50  # fixed-point iterations of the shared-cores slowdown


@dataclass(frozen=True)
class Evaluation:
    """One strategy / split at one offered rate."""

    ok: bool
    ttft_s: float
    tpot_s: float
    limit: str  # the first constraint that failed, or "" when ok
    utilisation: dict[str, float] = field(default_factory=dict)  # per pool: ρ (work share of its time)
    budgets: dict[str, Budgets] = field(default_factory=dict)  # per decode-carrying pool
    slowdown: float = 1.0  # shared cores: every compute cost is this many times the measured one


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    counts: tuple[tuple[str, int], ...]  # (pool, instances), in the strategy's pool order
    goodput: float  # requests/s meeting both SLOs
    ttft_s: float  # predicted at the goodput (inf when it is 0)
    tpot_s: float
    limit: str  # why not more

    def state(self) -> dict:
        return {
            "strategy": self.strategy,
            "counts": dict(self.counts),
            "goodput": self.goodput,
            "ttft_s": self.ttft_s if math.isfinite(self.ttft_s) else None,
            "tpot_s": self.tpot_s if math.isfinite(self.tpot_s) else None,
            "limit": self.limit,
        }


@dataclass(frozen=True)
class EPDChoice:
    best: StrategyResult
    table: list[StrategyResult]  # every strategy and split, best first


def splits(num_instances: int, num_pools: int) -> Iterator[tuple[int, ...]]:
    """Every way to give ``num_instances`` to ``num_pools`` pools, at least one each."""
    if num_pools == 1:
        yield (num_instances,)
        return
    for first in range(1, num_instances - num_pools + 2):
        for rest in splits(num_instances - first, num_pools - 1):
            yield (first, *rest)


@dataclass(frozen=True)
class _Pool:
    kind: str
    count: int
    work: float  # marginal seconds per request
    fixed: float  # per-step fixed cost f


def _pools(strategy: str, counts: tuple[int, ...], c: StageCosts, w: EPDWorkload) -> list[_Pool]:
    n, g, L = w.images_per_request, w.patches_per_image, w.prompt_len
    pools = []
    for kind, count in zip(STRATEGIES[strategy], counts, strict=True):
        work = 0.0
        if "E" in kind and n:
            work += n * g * c.encode_s_per_patch + (c.encode_s if kind != "E" else 0.0)
        if "P" in kind:
            work += c.prefill_s_per_token * L + c.prefill_s_per_token2 * L * L
        if "D" in kind:
            work += (w.output_tokens - 1) * (
                c.decode_s_per_seq + c.decode_s_per_context_token * w.mean_context
            )
        fixed = c.decode_s if "D" in kind else c.prefill_s if "P" in kind else c.encode_s
        pools.append(_Pool(kind, count, work, fixed))
    return pools


def evaluate(
    strategy: str,
    counts: tuple[int, ...],
    costs: StageCosts,
    workload: EPDWorkload,
    slo: EPDSLO,
    rate: float,
    cores: float | None = None,
) -> Evaluation:
    """Predicted TTFT / TPOT of ``strategy`` with ``counts`` instances per pool at ``rate`` requests/s;
    ``cores``: the instances share that many cores (None: one each, no contention)."""
    if cores is None:
        return _evaluate(strategy, counts, costs, workload, rate, slo)
    if not cores > 0:
        raise ValueError(f"cores must be > 0 or None, got {cores}")
    k = 1.0
    for _ in range(_CONTENTION_STEPS):  # demand grows with k and is at most the instance count: converges
        slowed = slow_down(costs, k)
        demand = cpu_demand(strategy, counts, slowed, workload, rate)
        k_next = max(1.0, demand / cores)
        if abs(k_next - k) <= 1e-4 * k:
            break
        k = k_next
    e = _evaluate(strategy, counts, slow_down(costs, k), workload, rate, slo)
    return dataclasses.replace(e, slowdown=k)


def slow_down(costs: StageCosts, k: float) -> StageCosts:
    """``costs`` with every compute coefficient ``k`` times as large (transfers unchanged)."""
    if k == 1.0:
        return costs
    names = (
        "encode_s", "encode_s_per_patch", "prefill_s", "prefill_s_per_token", "prefill_s_per_token2",
        "decode_s", "decode_s_per_seq", "decode_s_per_context_token",
    )  # fmt: skip
    return dataclasses.replace(costs, **{n: getattr(costs, n) * k for n in names})


def cpu_demand(
    strategy: str, counts: tuple[int, ...], costs: StageCosts, workload: EPDWorkload, rate: float
) -> float:
    """Cores the instances keep busy at ``rate``: a decode-carrying instance steps while any request is
    on it (``1 - exp(-r·T)``, ``T`` = the request's work there plus ``O - 1`` mean steps), any other
    instance for its busy share; each at most 1 (one thread)."""
    total = 0.0
    for p in _pools(strategy, counts, costs, workload):
        r = rate / p.count
        rho = r * p.work
        if "D" in p.kind:
            if rho >= 1:
                busy = 1.0
            else:
                held = p.work + (workload.output_tokens - 1) * p.fixed / (1 - rho)
                busy = 1 - math.exp(-r * held)
        else:
            busy = min(1.0, r * (p.work + p.fixed))
        total += p.count * busy
    return total


def _evaluate(
    strategy: str, counts: tuple[int, ...], costs: StageCosts, workload: EPDWorkload, rate: float, slo: EPDSLO
) -> Evaluation:
    w, c = workload, costs
    pools = _pools(strategy, counts, c, w)
    util = {p.kind: rate / p.count * p.work for p in pools}
    over = next((p for p in pools if util[p.kind] >= 1), None)
    if over is not None:
        return Evaluation(False, math.inf, math.inf, f"{over.kind} pool over capacity", util)
    steps = {p.kind: p.fixed / (1 - util[p.kind]) for p in pools}  # mean step time
    d_kind = next(p.kind for p in pools if "D" in p.kind)  # a step holds at least one decode
    steps[d_kind] = max(steps[d_kind], c.decode_step_s(1, w.mean_context))
    holder = {stage: next(p for p in pools if stage in p.kind) for stage in "EPD"}
    found: dict[str, Budgets] = {}
    ttft = 0.0
    d = holder["D"]
    r_d, s_d = rate / d.count, steps[d.kind]
    if s_d > slo.tpot_s:
        return Evaluation(False, math.inf, s_d, f"TPOT {s_d * 1e3:.1f} ms > SLO on the {d.kind} pool", util)
    batch = r_d * (w.output_tokens - 1) * s_d
    if batch > c.max_num_seqs:
        return Evaluation(False, math.inf, math.inf, f"decode batch {batch:.0f} > max_num_seqs", util)
    # at least one decode: a step with none has no TPOT to protect, but one arrives any moment
    batch = max(1.0, batch)
    b = budgets(
        c,
        slo.tpot_s,
        round(batch),
        context_tokens=batch * w.mean_context,
        patches_per_image=w.patches_per_image,
    )
    found[d.kind] = b
    if not b.feasible:
        return Evaluation(
            False, math.inf, s_d, f"TPOT: a step of {round(batch)} decodes alone takes {b.decode_only_s * 1e3:.1f} ms", util, found
        )  # fmt: skip
    share, over_slo = 0.0, 0.0
    n, L = w.images_per_request, w.prompt_len
    if "E" in d.kind and n:
        share += r_d * s_d * n / max(b.max_encode_images, 1)
        if b.max_encode_images == 0:
            over_slo = r_d * s_d * n
    if "P" in d.kind:
        if b.max_prefill_chunk < 1:
            return Evaluation(
                False,
                math.inf,
                s_d,
                f"no token budget for prefill beside {b.decode_batch} decodes",
                util,
                found,
            )
        share += r_d * s_d * L / b.max_prefill_chunk
    if share >= 1:
        return Evaluation(
            False, math.inf, s_d, f"{d.kind}: encode/prefill work needs {share:.0%} of the steps", util, found
        )
    if over_slo > MAX_OVER_SLO_STEP_SHARE:
        return Evaluation(
            False,
            math.inf,
            s_d,
            f"TPOT: {over_slo:.0%} of {d.kind} steps encode an image over the SLO",
            util,
            found,
        )
    queue = share / (2 * (1 - share))
    tpot = s_d
    if "P" not in d.kind and w.output_tokens > 1:  # the KV arrives before the second token
        tpot += c.transfer_time_s(L * c.kv_bytes_per_token) / (w.output_tokens - 1)
    # first-token path: E (if the request has images), embeddings E -> P, P
    visited: set[str] = set()
    for stage in ("E", "P"):
        p = holder[stage]
        if stage == "E" and not n:
            continue
        if p.kind == d.kind:
            ttft += _decode_pool_stage_s(stage, c, w, b, batch, s_d, queue, first=p.kind not in visited)
        else:
            ttft += _plain_pool_stage_s(stage, p, c, w, rate, steps[p.kind], first=p.kind not in visited)
        visited.add(p.kind)
    if n and holder["E"].kind != holder["P"].kind:
        ttft += c.transfer_time_s(n * w.image_tokens_per_image * c.embed_bytes_per_token)
    if tpot > slo.tpot_s:
        return Evaluation(
            False, ttft, tpot, f"TPOT {tpot * 1e3:.1f} ms > SLO on the {d.kind} pool", util, found
        )
    if ttft > slo.ttft_s:
        return Evaluation(False, ttft, tpot, f"TTFT {ttft * 1e3:.0f} ms > SLO", util, found)
    return Evaluation(True, ttft, tpot, "", util, found)


def _plain_pool_stage_s(
    stage: str, p: _Pool, c: StageCosts, w: EPDWorkload, rate: float, s: float, first: bool
) -> float:
    """A stage on an instance without decodes: wait for the step in progress (first stage there only),
    then a step of its own: the mean step plus this request's work."""
    busy = min(1.0, rate / p.count * (p.work + p.fixed))
    own = w.images_per_request * w.patches_per_image * c.encode_s_per_patch if stage == "E" else (
        c.prefill_s_per_token * w.prompt_len + c.prefill_s_per_token2 * w.prompt_len**2
    )  # fmt: skip
    return (busy * s / 2 if first else 0.0) + s + own


def _decode_pool_stage_s(
    stage: str, c: StageCosts, w: EPDWorkload, b: Budgets, batch: float, s: float, queue: float, first: bool
) -> float:
    """A stage on a decode instance: Algorithm 1's steps for it (τ_e images or a τ_t - B token chunk
    per step), each as long as a step with that work, after the requests ahead of it."""
    ctx = batch * w.mean_context
    if stage == "E":
        per_step = max(b.max_encode_images, 1)
        n = w.images_per_request
        steps = math.ceil(n / per_step)
        step = c.step_s(batch, ctx, encode_patches=min(n, per_step) * w.patches_per_image)
    else:
        chunk = b.max_prefill_chunk
        steps = math.ceil(w.prompt_len / chunk)
        step = c.step_s(batch, ctx, prefill_tokens=min(w.prompt_len, chunk))
    return (s / 2 if first else 0.0) + steps * step * (1 + queue)


def _goodput(
    strategy: str,
    counts: tuple[int, ...],
    costs: StageCosts,
    workload: EPDWorkload,
    slo: EPDSLO,
    cores: float | None = None,
) -> StrategyResult:
    pools = _pools(strategy, counts, costs, workload)
    caps = {p.kind: p.count / p.work for p in pools if p.work > 0}
    cap = min(caps.values(), default=1e9)
    offered = workload.request_rate is not None and workload.request_rate < cap
    hi = workload.request_rate if offered else cap
    top = evaluate(strategy, counts, costs, workload, slo, hi, cores)
    named = tuple(zip(STRATEGIES[strategy], counts))
    if top.ok:  # the offered rate, or (rounding) the capacity itself
        bottleneck = min(caps, key=caps.__getitem__) if caps else "no"
        why = "meets the SLOs at the offered rate" if offered else f"{bottleneck} pool over capacity"
        return StrategyResult(strategy, named, hi, top.ttft_s, top.tpot_s, why)
    low = evaluate(strategy, counts, costs, workload, slo, hi * 1e-9, cores)
    if not low.ok:
        return StrategyResult(strategy, named, 0.0, low.ttft_s, low.tpot_s, f"infeasible: {low.limit}")
    lo, best = hi * 1e-9, low
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        e = evaluate(strategy, counts, costs, workload, slo, mid, cores)
        if e.ok:
            lo, best = mid, e
        else:
            hi, top = mid, e
    return StrategyResult(strategy, named, lo, best.ttft_s, best.tpot_s, top.limit)


def choose_strategy(
    costs: StageCosts,
    workload: EPDWorkload,
    num_instances: int,
    slo: EPDSLO,
    strategies: tuple[str, ...] = tuple(STRATEGIES),
    cores: float | None = None,
) -> EPDChoice:
    """Predicted goodput of every strategy and split of ``num_instances`` (at least one per pool),
    best first (ties: fewer pools, then the split order), and the best. ``cores``: the instances share
    that many cores (None: one core each)."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {list(STRATEGIES)}")
    if num_instances < 1:
        raise ValueError(f"num_instances must be >= 1, got {num_instances}")
    table = [
        _goodput(s, counts, costs, workload, slo, cores)
        for s in strategies
        for counts in splits(num_instances, len(STRATEGIES[s]))
        if len(STRATEGIES[s]) <= num_instances
    ]
    if not table:
        raise ValueError(f"no strategy fits {num_instances} instance(s)")
    order = {s: i for i, s in enumerate(STRATEGIES)}
    table.sort(key=lambda r: (-round(r.goodput, 9), len(r.counts), order[r.strategy], r.counts))
    return EPDChoice(table[0], table)
