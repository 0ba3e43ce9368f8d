"""PrfaaS-PD in the cluster simulator (shared/papers/prefill-as-a-service.txt): a PrfaaS cluster of prefill
instances, a local PD cluster of prefill and decode instances, and the link between them.

Requests are placed by the service's own policies, unchanged: ``route_prefill`` picks the cluster (the
threshold on the uncached length, which ``BandwidthAwareScheduler`` moves as it samples the link every
``tick_s``), ``PDPolicy`` the prefill instance within it (least loaded) and the decode instance.

The time model is the throughput model's, per request rather than in the mean: a prefill instance
prefills one prompt at a time in its curve's ``T_prefill(l)``; a PrfaaS prefill's KV (``S_kv(l)``) then
crosses the link, first come first served at the link's bandwidth (which ``link_schedule`` may change
mid-run); a local one moves over the cluster's own fabric (``local_gbps``, no contention); a decode
instance runs up to ``BS_max`` streams, each ``L_out`` steps of ``T_decode``. A request's first token is
its first decode step's (its KV landed and a stream slot free).

``throughput_req_s`` of a run whose requests all arrive faster than the cluster serves them is its
capacity: the requests over the makespan, which the slowest stage sets -- what ``Lambda_max`` predicts.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from benchmarks.cluster_sim.trace import SimRequest
from xservice.policies.pd import PDPolicy
from xservice.policies.prfaas import PRFAAS, BandwidthAwareScheduler, LinkSample, route_prefill
from xservice.policies.prfaas.lengths import LengthDistribution
from xservice.policies.prfaas.model import Stages
from xservice.policies.routing import InstanceSnapshot, RouteRequest

_ARRIVE, _PREFILLED, _LANDED, _DECODED, _TICK = range(5)


@dataclass
class PrfaasSimConfig:
    prfaas: int  # PrfaaS prefill instances
    prefill: int  # local prefill instances
    decode: int  # local decode instances
    threshold: float  # initial routing threshold (inf: every prefill local; 0: every prefill on PrfaaS)
    output_tokens: int = 1024
    link_gbps: float = 100.0  # the PrfaaS cluster's egress
    local_gbps: float = 800.0  # the local cluster's P->D fabric
    scheduler: bool = (
        True  # the bandwidth-aware scheduler moves the threshold (else it only samples the link)
    )
    tick_s: float = 1.0  # short term: a link sample
    replan_s: float = 60.0  # long term: the threshold re-searched at the current split
    link_schedule: tuple[tuple[float, float], ...] = ()  # (at seconds, gbps): the link's capacity from then


@dataclass
class _Record:
    req: SimRequest
    cluster: str = ""
    prefill_end: float = 0.0
    first_token: float | None = None
    end: float | None = None


@dataclass
class _Prefiller:
    name: str
    cluster: str
    queue: deque = field(default_factory=deque)  # request ids, FCFS
    busy: int | None = None  # the request prefilling
    busy_s: float = 0.0


@dataclass
class _Decoder:
    name: str
    running: int = 0
    waiting: deque = field(default_factory=deque)
    assigned: int = 0  # routed here and not finished


class _Link:
    """First come, first served at the capacity in force when a transfer is queued."""

    def __init__(self, gbps: float) -> None:
        self.gbps, self.free_at = gbps, 0.0
        self.done_bytes = 0.0
        self.pending: deque[tuple[float, float, float]] = deque()  # (start, end, bytes)
        self.total_bytes = 0.0

    def send(self, now: float, size: float) -> float:
        start = max(now, self.free_at)
        end = start + size * 8 / (self.gbps * 1e9)
        self.free_at = end
        self.pending.append((start, end, size))
        self.total_bytes += size
        return end

    def sample(self, now: float) -> tuple[float, float]:
        """Bytes sent so far and bytes queued now."""
        while self.pending and self.pending[0][1] <= now:
            self.done_bytes += self.pending.popleft()[2]
        sent, queued = self.done_bytes, 0.0
        for start, end, size in self.pending:
            frac = min(1.0, max(0.0, (now - start) / (end - start))) if end > start else 1.0
            sent += size * frac
            queued += size * (1 - frac)
        return sent, queued


class PrfaasCluster:
    def __init__(self, config: PrfaasSimConfig, stages: Stages, lengths: LengthDistribution) -> None:
        c = config
        if c.prefill + c.prfaas < 1 or c.decode < 1:
            raise ValueError("a PrfaaS-PD cluster needs a prefill instance (either cluster) and a decode one")
        if c.prfaas and stages.prfaas is None:
            raise ValueError("PrfaaS instances need the PrfaaS prefill curve")
        self.config, self.stages = c, stages
        self.prefillers = [_Prefiller(f"prfaas{i}", PRFAAS) for i in range(c.prfaas)]
        self.prefillers += [_Prefiller(f"p{i}", "local") for i in range(c.prefill)]
        self.by_name = {p.name: p for p in self.prefillers}
        self.decoders = {f"d{i}": _Decoder(f"d{i}") for i in range(c.decode)}
        self.link = _Link(c.link_gbps)
        self.policy = PDPolicy()
        self.scheduler = (
            BandwidthAwareScheduler(c.threshold, stages.prfaas, lengths)
            if c.prfaas and c.prefill and stages.prfaas is not None
            else None
        )
        self.threshold = c.threshold
        self.records: dict[int, _Record] = {}
        self.events: list[tuple[float, int, int, int, str]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.trajectory: list[dict[str, float]] = []  # threshold changes and link samples
        self.max_utilization = 0.0
        self.max_queue_s = 0.0  # the link's largest backlog, in seconds of link time
        self._local_busy = 0.0  # the local prefill instances' busy seconds at the last tick

    def _push(self, t: float, kind: int, a: int = 0, name: str = "") -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, a, name))

    # ------------------------------------------------------------------ the loop
    def run(self, trace: list[SimRequest]) -> dict[str, Any]:
        for req in trace:
            self.records[req.rid] = _Record(req)
            self._push(req.arrival, _ARRIVE, req.rid)
        for at, gbps in self.config.link_schedule:
            self._push(at, _TICK, -1, str(gbps))
        if self.scheduler is not None:
            self._push(self.config.tick_s, _TICK)
            if self.config.scheduler:
                self._push(self.config.replan_s, _TICK, -2)
        left = len(trace)
        while self.events and left:
            self.now, _, kind, a, name = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self._arrive(self.records[a])
            elif kind == _PREFILLED:
                self._prefilled(self.by_name[name])
            elif kind == _LANDED:
                self._landed(self.records[a], self.decoders[name])
            elif kind == _DECODED:
                left -= 1
                self._decoded(self.records[a], self.decoders[name])
            elif a == -1:
                self.link.gbps = float(name)
            elif a == -2:
                self._replan()
                self._push(self.now + self.config.replan_s, _TICK, -2)
            else:
                self._tick()
                self._push(self.now + self.config.tick_s, _TICK)
        return self.summary()

    # ------------------------------------------------------------------ stages
    def _arrive(self, rec: _Record) -> None:
        if self.scheduler is not None:
            self.scheduler.record_length(rec.req.prompt)
            scarce = self.scheduler.last.bandwidth_scarce
        else:
            scarce = True
        has_local = any(p.cluster == "local" for p in self.prefillers)
        route = route_prefill(
            rec.req.prompt,
            self.threshold if has_local else 0.0,
            bandwidth_scarce=scarce,
            prfaas_available=self.config.prfaas > 0,
        )
        rec.cluster = route.cluster
        pool = [p for p in self.prefillers if p.cluster == route.cluster]
        shown = [InstanceSnapshot(p.name, "prefill", len(p.queue) + (p.busy is not None)) for p in pool]
        inst = self.by_name[self.policy.select_prefill(shown)]
        inst.queue.append(rec.req.rid)
        self._start_prefill(inst)

    def _curve(self, inst: _Prefiller):
        return self.stages.prfaas if inst.cluster == PRFAAS else self.stages.local

    def _start_prefill(self, inst: _Prefiller) -> None:
        if inst.busy is None and inst.queue:
            rid = inst.queue.popleft()
            inst.busy = rid
            dt = self._curve(inst).prefill_s(self.records[rid].req.prompt)
            inst.busy_s += dt
            self._push(self.now + dt, _PREFILLED, rid, inst.name)

    def _prefilled(self, inst: _Prefiller) -> None:
        rec = self.records[inst.busy]
        inst.busy = None
        rec.prefill_end = self.now
        shown = [InstanceSnapshot(d.name, "decode", d.assigned) for d in self.decoders.values()]
        dec = self.decoders[self.policy.select_decode(RouteRequest(), shown)]
        dec.assigned += 1
        size = self._curve(inst).kv_size(rec.req.prompt)
        if inst.cluster == PRFAAS:
            landed = self.link.send(self.now, size)
        else:
            landed = self.now + size * 8 / (self.config.local_gbps * 1e9)
        self._push(landed, _LANDED, rec.req.rid, dec.name)
        self._start_prefill(inst)

    def _landed(self, rec: _Record, dec: _Decoder) -> None:
        dec.waiting.append(rec.req.rid)
        self._start_decodes(dec)

    def _start_decodes(self, dec: _Decoder) -> None:
        rate = self.stages.decode
        while dec.waiting and dec.running < rate.max_batch:
            rid = dec.waiting.popleft()
            dec.running += 1
            rec = self.records[rid]
            rec.first_token = self.now + rate.step_s
            self._push(self.now + rate.step_s * rec.req.output, _DECODED, rid, dec.name)

    def _decoded(self, rec: _Record, dec: _Decoder) -> None:
        rec.end = self.now
        dec.running -= 1
        dec.assigned -= 1
        self._start_decodes(dec)

    def _tick(self) -> None:
        assert self.scheduler is not None
        sent, queued = self.link.sample(self.now)
        local = [p for p in self.prefillers if p.cluster != PRFAAS]
        busy = sum(p.busy_s for p in local)
        share = (busy - self._local_busy) / (len(local) * self.config.tick_s)
        self._local_busy = busy
        d = self.scheduler.observe(LinkSample(self.now, sent, queued, self.link.gbps, min(1.0, share)))
        self.max_utilization = max(self.max_utilization, d.utilization)
        self.max_queue_s = max(self.max_queue_s, d.queue_s)
        if not self.config.scheduler:
            d = replace(d, threshold=self.threshold, reason="hold")
        self._trace(d.threshold, d.egress_gbps, d.queue_s, d.reason)
        self.threshold = d.threshold

    def _replan(self) -> None:
        assert self.scheduler is not None
        c = self.config
        point = self.scheduler.replan(
            self.stages, c.output_tokens, c.prfaas, c.prefill + c.decode, prefill=c.prefill
        )
        self.threshold = point.deployment.threshold
        last = self.trajectory[-1] if self.trajectory else {"egress_gbps": 0.0, "queue_s": 0.0}
        self._trace(self.threshold, last["egress_gbps"], last["queue_s"], "plan")

    def _trace(self, threshold: float, egress: float, queue_s: float, reason: str) -> None:
        if reason != "hold" or not self.trajectory or self.now - self.trajectory[-1]["at_s"] >= 10:
            self.trajectory.append({
                "at_s": round(self.now, 1), "threshold": round(threshold), "link_gbps": self.link.gbps,
                "egress_gbps": round(egress, 3), "queue_s": round(queue_s, 3), "reason": reason,
            })  # fmt: skip

    # ------------------------------------------------------------------ report
    def summary(self) -> dict[str, Any]:
        recs = list(self.records.values())
        done = [r for r in recs if r.end is not None]
        start = min(r.req.arrival for r in recs)
        span = max(r.end for r in done) - start if done else 0.0
        ttft = np.array([r.first_token - r.req.arrival for r in done])
        offloaded = sum(1 for r in recs if r.cluster == PRFAAS)
        busy = lambda cl: [p.busy_s / span for p in self.prefillers if p.cluster == cl] if span else []  # noqa: E731
        out = {
            "num_requests": len(recs),
            "num_unfinished": len(recs) - len(done),
            "throughput_req_s": round(len(done) / span, 4) if span else 0.0,
            "ttft_s": {
                "mean": round(float(ttft.mean()), 3) if len(ttft) else 0.0,
                "p50": round(float(np.percentile(ttft, 50)), 3) if len(ttft) else 0.0,
                "p90": round(float(np.percentile(ttft, 90)), 3) if len(ttft) else 0.0,
            },
            "offload_fraction": round(offloaded / len(recs), 4),
            "egress_gbps_mean": round(self.link.total_bytes * 8 / span / 1e9, 3) if span else 0.0,
            "prefill_utilization": {
                "prfaas": round(float(np.mean(busy(PRFAAS))), 3) if self.config.prfaas else None,
                "local": round(float(np.mean(busy("local"))), 3) if self.config.prefill else None,
            },
            "span_s": round(span, 2),
        }
        if self.scheduler is not None:
            out["threshold_final"] = round(self.threshold) if math.isfinite(self.threshold) else None
            out["link_utilization_max"] = round(self.max_utilization, 3)
            out["link_backlog_s_max"] = round(self.max_queue_s, 3)
            out["trajectory"] = self.trajectory
        return out


def lognormal_trace(
    lengths, num_requests: int, rate: float, output_tokens: int, seed: int = 0
) -> list[SimRequest]:
    """Poisson arrivals at ``rate``; prompt lengths drawn from ``lengths`` (``LogNormalLengths``)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    prompts = lengths.sample(num_requests, seed=seed)
    return [SimRequest(i, float(a), int(p), output_tokens) for i, (a, p) in enumerate(zip(arrivals, prompts))]
