"""``PrfaasRouter``: the service's side of the PrfaaS cluster -- where each request prefills, the link
meter, the bandwidth-aware scheduler's loop, and what ``/metrics`` and ``xllm cluster status`` show.

``pick`` is asked by PD dispatching (``xservice/cluster/pd.py``) for every prefill: ``route_prefill``
(``xservice/policies/prfaas``) compares the request's uncached length (after the local cluster's prefix
caches, or the longest prefix anywhere when bandwidth is abundant) with the threshold; PrfaaS requests
go to the least-loaded healthy PrfaaS instance (``PDPolicy``), the others to the local prefill pool as
before. Every ``tick_s`` the scheduler samples the link (``link.py``); with ``plan_profiles`` it
re-plans every ``replan_s`` from the measured lengths and link.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xservice.cluster.prfaas.config import PrfaasConfig
from xservice.cluster.prfaas.link import LinkMeter
from xservice.cluster.remote_engine import RemoteEngineClient
from xservice.policies import PDPolicy
from xservice.policies.prfaas import (
    PRFAAS,
    BandwidthAwareScheduler,
    LinkSample,
    LogNormalLengths,
    PrefillCurve,
    decode_rate,
    prefill_curve,
    route_prefill,
)
from xservice.policies.prfaas.model import OperatingPoint, Stages, plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrfaasChoice:
    client: RemoteEngineClient | None  # the PrfaaS instance to prefill on (None: the local prefill pool)
    prefix_from: RemoteEngineClient | None  # bring the longest cached prefix from it first (None: no)
    prefix_tokens: int = 0


def _kv_curve(bytes_per_token: float) -> PrefillCurve:
    """A curve that knows only the KV size (what the short-term scheduler needs of it)."""
    return PrefillCurve("measured-kv", (1.0, 1e7), (1.0, 1.0), (bytes_per_token, bytes_per_token * 1e7))


class PrfaasRouter:
    def __init__(self, cfg: PrfaasConfig, pool: Any, local: Any) -> None:
        self.cfg = cfg
        self.pool = pool  # the PrfaaS cluster's InstancePool
        self.local = local  # the local cluster's
        self.meter = LinkMeter(cfg.link_gbps)
        self.policy = PDPolicy()
        self.bytes_per_token = 0.0  # of the PrfaaS instances' KV, learnt from their first export
        prior = LogNormalLengths(math.log(max(cfg.threshold_tokens, 16)), 1.0, 1, 1 << 20)
        self.scheduler = BandwidthAwareScheduler(
            cfg.threshold_tokens,
            _kv_curve(1.0),
            prior,
            high=cfg.high_utilization,
            low=cfg.low_utilization,
            target=(cfg.high_utilization + cfg.low_utilization) / 2,
            max_queue_s=cfg.max_queue_s,
        )
        self.threshold = float(cfg.threshold_tokens)
        self.counts = {
            "prfaas": 0, "local": 0, "threshold_raises": 0, "threshold_lowers": 0, "replans": 0,
            "prefix_transfers": 0, "prefix_tokens": 0, "rebalances": 0,
        }  # fmt: skip
        self.outputs: deque[int] = deque(maxlen=2048)  # output lengths of finished requests (re-planning)
        self.plan: dict[str, Any] | None = None
        self.local_tpot_ms = 100.0  # the TPOT SLO the decode rate is planned under (cluster.slo.tpot_ms)
        self.history: deque[dict[str, Any]] = deque(maxlen=32)  # threshold changes, newest last

    # ------------------------------------------------------------------ routing
    def owns(self, client: RemoteEngineClient | None) -> bool:
        return client is not None and self.pool.clients.get(client.name) is client

    def _healthy(self) -> list[Any]:
        return [s for s in self.pool.snapshots() if s.role == "prefill"]

    def _holders(self, pool: Any, kv_ids: list[int], names: set[str]) -> tuple[str | None, int]:
        """The instance of ``pool`` (among ``names``) with the longest cached prefix, and its tokens."""
        if not names:
            return None, 0
        matched = pool.route_request(kv_ids).matched_blocks or {}
        best = max(sorted(names), key=lambda n: matched.get(n, 0))
        return best, matched.get(best, 0) * pool.info.block_size

    def pick(self, kv_ids: list[int], cached_local: int, not_: str | None = None) -> PrfaasChoice:
        """Where this prompt prefills: a PrfaaS instance, or None for the local prefill pool; and, when
        bandwidth is abundant and the longest cached prefix sits in the other cluster, the instance to
        bring it from (``cached_local``: what the local prefill instances hold of it)."""
        total = len(kv_ids)
        shown = [s for s in self._healthy() if s.name != not_]
        prfaas_holder, cached_prfaas = self._holders(self.pool, kv_ids, {s.name for s in shown})
        # what a local prefill could start from: the prefill instances' caches (a decode instance's blocks
        # are no use to a prefill unless brought over, which only crosses-cluster pulls do)
        local_names = {s.name for s in self.local.snapshots() if s.role == "prefill"}
        local_holder, cached_anywhere_local = self._holders(self.local, kv_ids, local_names)
        scarce = self.scheduler.last.bandwidth_scarce or not self.cfg.scheduler
        self.scheduler.record_length(total - cached_local)
        route = route_prefill(
            total,
            self.threshold,
            cached_local=cached_local if scarce else max(cached_local, cached_anywhere_local),
            cached_prfaas=cached_prfaas,
            bandwidth_scarce=scarce,
            prfaas_available=bool(shown),
        )
        source = None
        if route.transfer_prefix:  # the longest prefix crosses to the cluster that computes
            holder = (self.pool, prfaas_holder) if route.reuse_from == PRFAAS else (self.local, local_holder)
            source = holder[0].clients.get(holder[1]) if holder[1] is not None else None
        if route.cluster != PRFAAS:
            self.counts["local"] += 1
            return PrfaasChoice(None, source, route.reused_tokens)
        # the PrfaaS instance holding the prefix the route counted on, else the least loaded
        name = prfaas_holder if cached_prfaas > 0 and route.reuse_from == PRFAAS else None
        name = name or self.policy.select_prefill(shown)
        client = self.pool.clients.get(name) if name is not None else None
        if client is None:
            self.counts["local"] += 1
            return PrfaasChoice(None, None)
        self.counts["prfaas"] += 1
        return PrfaasChoice(client, source, route.reused_tokens)

    def learn_export(self, num_blocks: int, block_bytes: int, num_layers: int, block_size: int) -> float:
        """The bytes an import of this export moves at most; learns the KV bytes per token."""
        if block_size and not self.bytes_per_token:
            self.bytes_per_token = block_bytes * 2 * num_layers / block_size
            self.scheduler.curve = _kv_curve(self.bytes_per_token)
        return float(num_blocks * block_bytes * 2 * num_layers)

    def finished(self, num_output_tokens: int) -> None:
        self.outputs.append(num_output_tokens)

    # ------------------------------------------------------------------ the scheduler
    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m = self.meter
        # the local prefill instances with a queue: when all have one, moving requests off the link
        # would only move the queue (the scheduler then holds)
        local = [s for s in self.local.snapshots() if s.role == "prefill"]
        busy = sum(1.0 for s in local if s.num_waiting > 0) / len(local) if local else None
        sample = LinkSample(now, m.sent_bytes, m.queued_bytes, m.capacity_gbps(now), busy, m.oldest_s(now))
        decision = self.scheduler.observe(sample)
        if not self.cfg.scheduler:
            return
        if decision.reason in ("raise", "lower"):
            self.counts["threshold_raises" if decision.reason == "raise" else "threshold_lowers"] += 1
            self._moved(decision.threshold, decision.reason, decision.utilization, decision.queue_s)

    def _moved(self, threshold: float, reason: str, util: float, queue_s: float) -> None:
        logger.info("prfaas: threshold %s %.0f -> %.0f (link %.0f%%, backlog %.1f s)", reason, self.threshold,
                    threshold, util * 100, queue_s)  # fmt: skip
        self.threshold = threshold
        self.history.append({
            "at": time.time(), "threshold_tokens": round(threshold), "reason": reason,
            "utilization": round(util, 3), "queue_s": round(queue_s, 3),
        })  # fmt: skip

    def replan(self, capacity_gbps: float | None = None) -> OperatingPoint | None:
        """Long term: the grid search over the measured lengths, outputs and link (``plan_profiles``;
        ``capacity_gbps``: the link's, read on the event loop by the caller)."""
        paths = self.cfg.profile_paths()
        if paths is None or not self.cfg.scheduler:
            return None
        fast, local = (json.loads(Path(p).read_text()) for p in paths)
        outputs = list(self.outputs) or [256]
        out = sum(outputs) / len(outputs)
        lengths = self.scheduler.distribution()
        slo_tokens = 1000.0 / max(self.local_tpot_ms, 1e-3)
        stages = Stages(
            local=prefill_curve(local),
            decode=decode_rate(local, slo_tokens_per_s=slo_tokens, context_tokens=lengths.mean() + out / 2),
            prfaas=prefill_curve(fast),
            bandwidth_gbps=self.meter.capacity_gbps() if capacity_gbps is None else capacity_gbps,
            service="mean",  # measured lengths: each stage's mean service time
        )
        roles = [s.role for s in self.local.snapshots()]
        n_prfaas, n_local = len(self._healthy()), roles.count("prefill") + roles.count("decode")
        if n_prfaas < 1 or n_local < 2:
            return None
        now = min(max(1, roles.count("prefill")), n_local - 1)
        point = plan(stages, lengths, out, n_prfaas, n_local, splits=[now])  # the threshold at today's split
        best = plan(stages, lengths, out, n_prfaas, n_local)  # the split to convert to
        self.scheduler.planned = self.scheduler.threshold = point.deployment.threshold
        self.counts["replans"] += 1
        self.plan = {
            "threshold_tokens": round(point.deployment.threshold),
            "lambda_max_req_s": round(point.lambda_max, 4),
            "bottleneck": point.bottleneck,
            "recommended_split": {
                "prefill": best.deployment.prefill,
                "decode": best.deployment.decode,
                "lambda_max_req_s": round(best.lambda_max, 4),
            },  # fmt: skip
        }
        self._moved(
            point.deployment.threshold, "plan", self.scheduler.last.utilization, self.scheduler.last.queue_s
        )
        return point

    async def run(self) -> None:
        """The scheduler's loop: a link sample every ``tick_s``, a re-plan every ``replan_s``."""
        last_plan = time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            try:
                self.sample()
                if time.monotonic() - last_plan >= self.cfg.replan_s:
                    last_plan = time.monotonic()
                    if await asyncio.to_thread(self.replan, self.meter.capacity_gbps()) is not None:
                        self.rebalance()
            except Exception:  # noqa: BLE001 - the scheduler must not stop serving
                logger.exception("prfaas scheduler tick failed")

    def rebalance(self) -> str | None:
        """Long term, with dynamic PD: flip one local instance toward the plan's P/D split (one a
        period: traffic at this timescale moves slowly); the instance flipped, if any."""
        dynamic = getattr(self.local, "dynamic", None)
        if dynamic is None or self.plan is None:
            return None
        want = self.plan["recommended_split"]["prefill"]
        snaps = [s for s in self.local.snapshots() if s.role in ("prefill", "decode")]
        have = sum(1 for s in snaps if s.role == "prefill")
        if want == have:
            return None
        src, dst = ("decode", "prefill") if want > have else ("prefill", "decode")
        reason = (
            f"{want}P/{len(snaps) - want}D plans {self.plan['recommended_split']['lambda_max_req_s']} req/s"
        )
        for snap in sorted((s for s in snaps if s.role == src), key=lambda s: (s.load, s.name)):
            try:
                dynamic.manual_flip(snap.name, dst, reason, source="prfaas plan")
            except (KeyError, ValueError):
                continue
            self.counts["rebalances"] += 1
            return snap.name
        return None

    # ------------------------------------------------------------------ what is shown
    def view(self) -> dict[str, Any]:
        d = self.scheduler.last
        return {
            "enabled": True,
            "instances": sorted(s.name for s in self._healthy()),
            "threshold_tokens": round(self.threshold),
            "planned_threshold_tokens": round(self.scheduler.planned),
            "scheduler": self.cfg.scheduler,
            "link": {
                "configured_gbps": self.meter.configured_gbps,
                "capacity_gbps": round(self.meter.capacity_gbps(), 4),
                "egress_gbps": round(d.egress_gbps, 4),
                "utilization": round(d.utilization, 4),
                "queue_s": round(d.queue_s, 4),
                "queued_bytes": int(self.meter.queued_bytes),
                "sent_bytes": int(self.meter.sent_bytes),
                "transfers": self.meter.num_transfers,
                "bandwidth_scarce": d.bandwidth_scarce,
            },
            "requests": dict(self.counts),
            "plan": self.plan,
            "history": list(self.history)[-8:],
        }
