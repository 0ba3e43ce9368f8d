"""``RuntimeMonitor``: what dynamic PD knows about each instance right now (xLLM report §3.2).

Two sources feed it:

- **the engines' load reports** (every heartbeat): raw samples of finished prefills
  ``[uncached tokens, queue s, compute s]`` and of steps ``[sequences, context tokens, prefill
  tokens, step s]``, which refit the instance's ``TTFTPredictor`` / ``TPOTPredictor`` online
  (``xservice/policies/predictors.py``); start-up profiling seeds them (``profiling.py``);
- **the service's own view** of the work it sent: prefills in flight per instance (their predicted
  compute is the instance's estimated queueing), decode streams per instance (count and context
  tokens), the inter-token gaps those streams see (the observed TPOT), and how much of the last
  ``idle_s`` each instance had a prefill in flight (its prefill utilization).

``snapshot`` turns this into the ``PDInstance`` list the pure policy decides on. Every predicted
TTFT is checked against the TTFT that followed (``record_error``), exported in ``/metrics``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from xengine.api.cluster import keys
from xservice.policies.dynamic_pd import PDInstance
from xservice.policies.predictors import TPOTPredictor, TTFTPredictor

logger = logging.getLogger(__name__)

TPOT_EWMA_ALPHA = 0.2
CAPACITY_MARGIN = 0.9  # of an instance's KV pool that decode placement may fill


@dataclass
class _Prefill:
    uncached: int
    compute_s: float  # predicted at dispatch
    predicted_ttft_s: float
    sent_at: float


@dataclass
class InstanceMonitor:
    name: str
    capacity_tokens: int = 1 << 62
    ttft: TTFTPredictor = field(default_factory=TTFTPredictor)
    tpot: TPOTPredictor = field(default_factory=TPOTPredictor)
    last_report: tuple[str, int] | None = None  # (incarnation, seq) ingested
    prefills: dict[str, _Prefill] = field(default_factory=dict)  # sub id -> in flight
    decodes: dict[str, int] = field(default_factory=dict)  # req id -> context tokens
    # req id -> (context, KV it may grow to) of streams placed here (dynamic PD), from placement until
    # the request ends: counted before their first decoded token, and in capacity at their full size
    reserved: dict[str, tuple[int, int]] = field(default_factory=dict)
    offline: set[str] = field(default_factory=set)  # of ``decodes``, the offline ones (co-location)
    slos: dict[str, float] = field(default_factory=dict)  # of ``decodes``, online ones' own TPOT SLO
    last_token_at: dict[str, float] = field(default_factory=dict)
    observed_step_s: float | None = None
    over_slo_since: float | None = None
    busy: deque[tuple[float, float]] = field(default_factory=deque)  # prefill in flight [start, end)
    busy_start: float | None = None
    role_since: float = field(default_factory=time.monotonic)
    num_prefills: int = 0
    num_decodes: int = 0

    def queue_s(self, now: float) -> float:
        """Predicted time until the prefills already sent here are done."""
        if not self.prefills:
            return 0.0
        oldest = min(p.sent_at for p in self.prefills.values())
        total = sum(p.compute_s for p in self.prefills.values())
        return max(0.0, total - (now - oldest))

    def utilization(self, now: float, window_s: float) -> float:
        """Fraction of the last ``window_s`` with a prefill in flight; 1.0 until the instance has
        served its current role for a whole window (not known to be idle yet)."""
        start = now - window_s
        if self.role_since > start:
            return 1.0
        while self.busy and self.busy[0][1] <= start:
            self.busy.popleft()
        busy = sum(min(e, now) - max(s, start) for s, e in self.busy)
        if self.busy_start is not None:
            busy += now - max(self.busy_start, start)
        return min(1.0, busy / window_s)


class RuntimeMonitor:
    def __init__(self, idle_s: float = 3.0) -> None:
        self.idle_s = idle_s
        self.instances: dict[str, InstanceMonitor] = {}

    def get(self, name: str) -> InstanceMonitor:
        mon = self.instances.get(name)
        if mon is None:
            mon = self.instances[name] = InstanceMonitor(name)
        return mon

    def role_changed(self, name: str) -> None:
        mon = self.get(name)
        mon.role_since = time.monotonic()
        mon.over_slo_since = None

    # ------------------------------------------------------------------ engine reports

    def ingest(self, name: str, report: keys.LoadReport) -> None:
        mon = self.get(name)
        tag = (report.incarnation, report.seq)
        if mon.last_report == tag:
            return  # the registry replays the latest report after a resync
        mon.last_report = tag
        try:
            for sample in getattr(report, "prefills", None) or []:
                uncached, _queue_s, compute_s = sample[:3]
                if uncached > 0:
                    mon.ttft.observe(int(uncached), max(0.0, float(compute_s)))
            for sample in getattr(report, "steps", None) or []:
                num_seqs, context, prefill_tokens, step_s = sample[:4]
                if num_seqs > 0:
                    mon.tpot.observe(
                        int(num_seqs), int(context), max(0.0, float(step_s)), int(prefill_tokens)
                    )
        except (ValueError, TypeError):  # a malformed report must not break routing: skip the rest
            logger.warning("malformed performance samples from %s ignored", name)

    # ------------------------------------------------------------------ the service's own view

    def prefill_sent(self, name: str, sub_id: str, uncached: int, now: float | None = None) -> float:
        """A prefill of ``uncached`` tokens went to ``name``; returns its predicted TTFT."""
        now = time.monotonic() if now is None else now
        mon = self.get(name)
        predicted = mon.ttft.predict(uncached, mon.queue_s(now))
        if not mon.prefills:
            mon.busy_start = now
        mon.prefills[sub_id] = _Prefill(uncached, mon.ttft.compute_s(uncached), predicted, now)
        mon.num_prefills += 1
        return predicted

    def prefill_done(self, name: str, sub_id: str, got_token: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        mon = self.get(name)
        p = mon.prefills.pop(sub_id, None)
        if p is None:
            return
        if got_token and mon.ttft.ready:
            mon.ttft.record_error(p.predicted_ttft_s, now - p.sent_at)
        if not mon.prefills and mon.busy_start is not None:
            mon.busy.append((mon.busy_start, now))
            mon.busy_start = None

    def decode_started(
        self,
        name: str,
        req_id: str,
        context_tokens: int,
        offline: bool = False,
        tpot_slo_s: float | None = None,
    ) -> None:
        """A decode stream started on ``name`` (``tpot_slo_s``: an online stream's own SLO, if it set one)."""
        mon = self.get(name)
        mon.decodes[req_id] = context_tokens
        if offline:
            mon.offline.add(req_id)
        elif tpot_slo_s is not None:
            mon.slos[req_id] = tpot_slo_s
        mon.num_decodes += 1

    def decode_tokens(self, name: str, req_id: str, num_tokens: int, tpot_slo_s: float, now: float) -> None:
        """``num_tokens`` more tokens of a decode stream on ``name`` arrived at ``now``."""
        mon = self.instances.get(name)
        if mon is None or req_id not in mon.decodes or num_tokens <= 0:
            return
        mon.decodes[req_id] += num_tokens
        last = mon.last_token_at.get(req_id)
        mon.last_token_at[req_id] = now
        if last is None:
            return
        gap = (now - last) / num_tokens
        ewma = mon.observed_step_s
        mon.observed_step_s = gap if ewma is None else (1 - TPOT_EWMA_ALPHA) * ewma + TPOT_EWMA_ALPHA * gap
        if mon.observed_step_s > tpot_slo_s:
            mon.over_slo_since = mon.over_slo_since or now
        else:
            mon.over_slo_since = None

    def reserve_decode(self, name: str, req_id: str, context_tokens: int, reserve_tokens: int) -> None:
        """A decode stream was placed on ``name``; it holds ``reserve_tokens`` of its KV until released."""
        self.get(name).reserved[req_id] = (context_tokens, max(context_tokens, reserve_tokens))

    def release_decode(self, req_id: str) -> None:
        """The request ended (or left for another instance): drop its reservations."""
        for mon in self.instances.values():
            mon.reserved.pop(req_id, None)

    def decode_done(self, name: str, req_id: str) -> None:
        mon = self.instances.get(name)
        if mon is None:
            return
        mon.decodes.pop(req_id, None)
        mon.offline.discard(req_id)
        mon.slos.pop(req_id, None)
        mon.last_token_at.pop(req_id, None)
        if not mon.decodes:
            mon.observed_step_s, mon.over_slo_since = None, None

    # ------------------------------------------------------------------ snapshots

    def snapshot(
        self, name: str, origin: str, role: str, last_flip_at: float | None, now: float
    ) -> PDInstance:
        mon = self.get(name)
        pending = [ctx for rid, (ctx, _) in mon.reserved.items() if rid not in mon.decodes]
        unreserved = sum(ctx for rid, ctx in mon.decodes.items() if rid not in mon.reserved)
        return PDInstance(
            name=name,
            origin=origin,
            role=role,
            queue_s=mon.queue_s(now),
            num_prefilling=len(mon.prefills),
            num_decoding=len(mon.decodes) + len(pending),
            decode_tokens=sum(mon.decodes.values()) + sum(pending),
            reserved_tokens=sum(full for _, full in mon.reserved.values()) + unreserved,
            capacity_tokens=mon.capacity_tokens,
            observed_step_s=mon.observed_step_s,
            prefill_utilization=mon.utilization(now, self.idle_s),
            busy_since=mon.over_slo_since,
            last_flip_at=last_flip_at,
            ttft=mon.ttft,
            tpot=mon.tpot,
        )

    def view(self, name: str, now: float) -> dict:
        mon = self.get(name)
        return {
            "ttft": mon.ttft.state(),
            "tpot": mon.tpot.state(),
            "queue_s": round(mon.queue_s(now), 4),
            "num_prefilling": len(mon.prefills),
            "num_decoding": len(mon.decodes),
            "decode_tokens": sum(mon.decodes.values()),
            "reserved_tokens": sum(full for _, full in mon.reserved.values()),
            "capacity_tokens": mon.capacity_tokens if mon.capacity_tokens < 1 << 62 else None,
            "observed_tpot_s": None if mon.observed_step_s is None else round(mon.observed_step_s, 4),
            "prefill_utilization": round(mon.utilization(now, self.idle_s), 3),
            "num_prefills": mon.num_prefills,
            "num_decodes": mon.num_decodes,
        }


def capacity_tokens(info: dict) -> int:
    """The KV tokens decode placement may fill on an instance (``EngineInfo`` as a dict)."""
    blocks, block_size = info.get("num_total_blocks") or 0, info.get("block_size") or 0
    return int(blocks * block_size * CAPACITY_MARGIN) if blocks and block_size else 1 << 62
