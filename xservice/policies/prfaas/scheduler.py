"""The dual-timescale, bandwidth-aware scheduler (paper section 3.4.3), as a pure state machine fed with
measurements.

**Short term** (``observe``, every link sample): the PrfaaS egress rate is the growth of the link's byte
counter, averaged over ``smoothing_s`` (one long prompt's KV is seconds of link time), its queue the
bytes still waiting to cross (in seconds of link time, or the age of the oldest transfer in flight,
whichever is longer). Near the ceiling -- utilisation at
or above ``high``, or a backlog of more than ``max_queue_s`` seconds of link time -- the threshold rises
to where the predicted egress falls back to ``target`` of the link (egress scales with
``P(L > t) * S_kv(E[L | L > t])`` over the measured uncached lengths, less what draining the backlog
needs) -- unless the local prefill instances are already busy ``local_headroom`` of the time: then the
whole cluster is saturated, and moving requests off the link would only move the queue. With the link
at or below ``low`` and no backlog, the threshold steps back down toward the
planned one. A change waits ``cooldown_s`` after the last, so the measurement reflects it.

**Long term** (``replan``): the throughput model's grid search over the measured length distribution
and the current instance counts gives a new planned threshold and the local P/D split to convert to
(the dynamic-PD machinery flips the roles).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from xservice.policies.prfaas.lengths import EmpiricalLengths, LengthDistribution
from xservice.policies.prfaas.model import OperatingPoint, Stages, plan
from xservice.policies.prfaas.profiles import PrefillCurve


@dataclass(frozen=True)
class LinkSample:
    at: float  # seconds (monotonic)
    sent_bytes: float  # the link's cumulative egress
    queued_bytes: float  # waiting to cross now
    bandwidth_gbps: float  # the link's capacity B_out
    local_prefill_busy: float | None = None  # the local prefill instances' busy share since the last sample
    oldest_s: float = 0.0  # how long the oldest transfer still in flight has waited


@dataclass(frozen=True)
class SchedulerDecision:
    threshold: float
    planned_threshold: float
    reason: str  # "hold", "raise", "lower", "plan"
    egress_gbps: float
    utilization: float
    queue_s: float  # the backlog in seconds of link time
    ceiling_req_s: float | None  # B_out / S_kv(l_long) at the threshold
    bandwidth_scarce: bool  # the routing regime (section 3.4.3)


class BandwidthAwareScheduler:
    def __init__(
        self,
        planned_threshold: float,
        prfaas_curve: PrefillCurve,
        lengths: LengthDistribution,
        *,
        high: float = 0.85,
        low: float = 0.5,
        target: float = 0.7,
        local_headroom: float = 0.9,
        max_queue_s: float = 5.0,
        drain_s: float = 10.0,
        max_step: float = 1.5,
        cooldown_s: float = 5.0,
        smoothing_s: float = 5.0,
        window: int = 2048,
    ) -> None:
        if not 0 < low < target < high <= 1:
            raise ValueError("the scheduler needs 0 < low < target < high <= 1")
        self.planned = self.threshold = float(planned_threshold)
        self.curve, self.prior = prfaas_curve, lengths
        self.high, self.low, self.target, self.local_headroom = high, low, target, local_headroom
        self.max_queue_s, self.cooldown_s = max_queue_s, cooldown_s
        self.drain_s, self.max_step, self.smoothing_s = drain_s, max_step, smoothing_s
        self.lengths: deque[int] = deque(maxlen=window)  # recent uncached lengths
        self._last: LinkSample | None = None
        self._changed_at = -math.inf
        self.egress_gbps = 0.0
        self.last = SchedulerDecision(self.threshold, self.planned, "plan", 0.0, 0.0, 0.0, None, False)

    # ------------------------------------------------------------------ inputs
    def record_length(self, uncached_tokens: int) -> None:
        """An arriving request's uncached length after prefix matching."""
        self.lengths.append(max(0, int(uncached_tokens)))

    def distribution(self) -> LengthDistribution:
        """The measured uncached lengths once there are enough of them, else the planned distribution."""
        return EmpiricalLengths(tuple(self.lengths)) if len(self.lengths) >= 64 else self.prior

    def _load(self, threshold: float, lengths: LengthDistribution) -> float:
        """Bytes per arriving request the link carries at ``threshold``."""
        s = lengths.split(threshold)
        return s.p * self.curve.kv_size(s.l_long) if s.p > 0 else 0.0

    # ------------------------------------------------------------------ short term
    def observe(self, sample: LinkSample) -> SchedulerDecision:
        prev, self._last = self._last, sample
        if prev is not None and sample.at > prev.at:
            dt = sample.at - prev.at
            rate = max(0.0, sample.sent_bytes - prev.sent_bytes) * 8 / dt / 1e9
            weight = 1.0 - math.exp(-dt / self.smoothing_s) if self.smoothing_s > 0 else 1.0
            self.egress_gbps += weight * (rate - self.egress_gbps)  # a moving average over smoothing_s
        cap = max(sample.bandwidth_gbps, 1e-9)
        util = self.egress_gbps / cap
        queue_s = max(sample.queued_bytes * 8 / (cap * 1e9), sample.oldest_s)
        reason = "hold"
        if sample.at - self._changed_at >= self.cooldown_s:
            lengths = self.distribution()
            local_full = (sample.local_prefill_busy or 0.0) >= self.local_headroom
            if (util >= self.high or queue_s >= self.max_queue_s) and not local_full:
                # the egress the link can take while it drains its backlog over drain_s
                drain = sample.queued_bytes * 8 / 1e9 / max(self.drain_s, 1e-9)
                want = max(self.target * cap - drain, self.low * cap)
                new = self._threshold_for(want, lengths, up=True)
                if new > self.threshold:
                    self.threshold, reason = new, "raise"
            elif util <= self.low and queue_s < self.max_queue_s / 4 and self.threshold > self.planned:
                new = max(self.planned, self._threshold_for(self.target * cap, lengths, up=False))
                if new < self.threshold:
                    self.threshold, reason = new, "lower"
            if reason != "hold":
                self._changed_at = sample.at
        s = self.distribution().split(self.threshold)
        ceiling = cap * 1e9 / 8 / self.curve.kv_size(s.l_long) if s.p > 0 else None
        self.last = SchedulerDecision(
            self.threshold,
            self.planned,
            reason,
            round(self.egress_gbps, 6),
            util,
            queue_s,
            ceiling,
            util > self.low,
        )
        return self.last

    def _threshold_for(self, want_gbps: float, lengths: LengthDistribution, up: bool) -> float:
        """The threshold at which the egress measured now scales to ``want_gbps`` (egress per request
        falls as the threshold rises). Rising: at least 10% above the current one, so a noisy sample
        still makes progress."""
        now = self._load(self.threshold, lengths)
        base = max(self.threshold, 1.0)  # (a threshold of 0 still rises)
        if now <= 0 or self.egress_gbps <= 0:  # nothing to scale from: a fixed step
            if up:
                return max(self.threshold, min(base * 1.25, lengths.hi))
            return max(self.planned, self.threshold / self.max_step)
        goal = now * want_gbps / self.egress_gbps  # bytes per request wanted
        lo, hi = math.log(max(self.planned, 1.0)), math.log(max(lengths.hi, self.threshold) * 2)
        for _ in range(50):
            mid = (lo + hi) / 2
            if self._load(math.exp(mid), lengths) > goal:
                lo = mid
            else:
                hi = mid
        t = math.exp(hi)
        if up:  # at least 10% (a noisy sample still makes progress), at most max_step at a time, and
            # no further than the longest length seen (past it nothing is offloaded any more)
            t = min(max(t, base * 1.1), base * self.max_step)
            return max(self.threshold, min(t, lengths.hi))
        return max(t, self.threshold / self.max_step)

    # ------------------------------------------------------------------ long term
    def replan(
        self,
        stages: Stages,
        output_tokens: float,
        prfaas_instances: int,
        local_instances: int,
        *,
        prefill: int | None = None,
    ) -> OperatingPoint:
        """Re-run the grid search on the measured lengths and the link's measured capacity; adopt its
        threshold as the planned one (and the current one). The caller converts the local instances to the
        point's P/D split -- or passes the split it keeps (``prefill``) and gets that split's best threshold."""
        if self._last is not None:
            stages = replace(stages, bandwidth_gbps=self._last.bandwidth_gbps)
        splits = None if prefill is None else [prefill]
        point = plan(
            stages, self.distribution(), output_tokens, prfaas_instances, local_instances, splits=splits
        )
        self.planned = self.threshold = point.deployment.threshold
        self.last = SchedulerDecision(
            self.threshold, self.planned, "plan", self.last.egress_gbps, self.last.utilization, self.last.queue_s,
            point.ceiling_req_s, self.last.bandwidth_scarce,
        )  # fmt: skip
        return point
