"""``Colocation``: the service side of online/offline co-location (xLLM report §3.1).

Pools are the PD roles: prefill-role instances form the latency-relaxed pool, decode-role instances
the latency-strict pool (with dynamic PD, the roles of the moment). The PD dispatcher asks it two
things about an offline request (``priority: offline``, batch-job lines): where it prefills (the
relaxed instance with the least prefill in flight; it never triggers a role flip and has no TTFT
SLO) and where it decodes (``ColocationPolicy.select_offline_decode``: a strict instance whose
batch the roofline model says keeps the TPOT SLO with it, else its relaxed instance, with no KV
transfer). Online requests run PD as before; on a relaxed instance they stop offline prefill steps
between layers (the engines' ``scheduler.offline_preemption: layer``).

When online load on a strict instance rises (more streams, or a stream asking for a tighter TPOT
SLO) so that its batch no longer holds the SLO, ``run`` moves offline decodes off it, back to a
relaxed instance (the one it prefilled on, whose prefix cache still holds its prompt): see
``ColocationPolicy.select_evictions`` and ``eviction.py``.

Each instance's ``RooflineModel`` is built from what it reports at start-up (weights, parameters, KV
bytes per token, threads) and corrected online from the step samples of its load reports.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from xengine.api.cluster import keys
from xservice.cluster.eviction import Evictions
from xservice.cluster.monitor import RuntimeMonitor, capacity_tokens
from xservice.cluster.remote_engine import RemoteEngineClient
from xservice.policies.colocation import (
    CPU_MEM_BW,
    CPU_PEAK_FLOPS_PER_THREAD,
    ColocationPolicy,
    Eviction,
    OfflineDecodeChoice,
    RooflineModel,
    RooflineSpec,
    StrictInstance,
)

REBALANCE_S = 0.25  # how often strict instances are checked for offline decodes to move off
PREFILLED_ON_TTL_S = 3600.0  # how long an offline decode's relaxed instance is remembered


class Colocation:
    def __init__(
        self,
        policy: ColocationPolicy,
        monitor: RuntimeMonitor,
        peak_flops_per_thread: float = CPU_PEAK_FLOPS_PER_THREAD,
        mem_bw: float = CPU_MEM_BW,
    ) -> None:
        self.policy = policy
        self.monitor = monitor
        self.peak_flops_per_thread = peak_flops_per_thread
        self.mem_bw = mem_bw
        self.models: dict[str, RooflineModel] = {}
        self.counters = {
            "offline_prefills": 0,
            "offline_decodes_strict": 0,
            "offline_decodes_relaxed": 0,
            "offline_evictions": 0,
        }
        self.last_choice: OfflineDecodeChoice | None = None
        self.last_eviction: Eviction | None = None
        self.prefilled_on: dict[str, tuple[str, float]] = {}  # offline decode on strict -> (relaxed, when)
        self._role: Callable[[str], str] = lambda name: "mixed"
        self._healthy: Callable[[], list[str]] = list
        self._evictions: Evictions | None = None

    def attach(
        self, role: Callable[[str], str], healthy: Callable[[], list[str]], evictions: Evictions | None = None
    ) -> None:
        """The pool's current role of an instance, its healthy instance names and its evictions."""
        self._role, self._healthy, self._evictions = role, healthy, evictions

    def instance_joined(self, client: RemoteEngineClient) -> None:
        info = dict(client.record.info)
        threads = max(1, int(info.get("num_threads") or 1))
        params = float(info.get("num_params") or 0)
        spec = RooflineSpec(
            peak_flops=self.peak_flops_per_thread * threads,
            mem_bw=self.mem_bw,
            weight_bytes=float(info.get("weight_bytes") or 4 * params),
            flops_per_token=2 * params,
            kv_bytes_per_token=float(info.get("kv_bytes_per_token") or 0),
        )
        self.models[client.name] = RooflineModel(spec)
        self.monitor.get(client.name).capacity_tokens = capacity_tokens(info)

    def ingest(self, name: str, report: keys.LoadReport) -> None:
        """Step samples of a load report correct the instance's roofline (registry load listener)."""
        model = self.models.get(name)
        if model is None:
            return
        for sample in getattr(report, "steps", None) or []:
            try:
                num_seqs, context, prefill_tokens, step_s = (float(v) for v in sample[:4])
            except (TypeError, ValueError):
                continue
            if num_seqs > 0 and step_s > 0:
                model.observe(int(num_seqs), int(context), int(prefill_tokens), step_s)

    # ------------------------------------------------------------------ decisions

    def relaxed(self) -> list[str]:
        return [n for n in self._healthy() if self._role(n) == "prefill"]

    def strict(self) -> list[StrictInstance]:
        out = []
        for name in self._healthy():
            model = self.models.get(name)
            if self._role(name) != "decode" or model is None:
                continue
            mon = self.monitor.get(name)
            moving = self._evictions if self._evictions is not None else ()
            offline = tuple((r, c) for r, c in mon.decodes.items() if r in mon.offline and r not in moving)
            out.append(
                StrictInstance(
                    name,
                    model,
                    len(mon.decodes) - len(offline),
                    len(offline),
                    sum(mon.decodes.values()),
                    mon.capacity_tokens,
                    min(mon.slos.values(), default=None),
                    offline,
                    mon.observed_step_s,
                )
            )
        return out

    def pick_offline_prefill(self, exclude: str | None = None, count: bool = True) -> str | None:
        """The relaxed instance with the fewest prefills in flight (None: no relaxed instance)."""
        names = [n for n in self.relaxed() if n != exclude]
        if not names:
            return None
        if count:
            self.counters["offline_prefills"] += 1
        now = time.monotonic()
        return min(names, key=lambda n: (self.monitor.get(n).queue_s(now), len(self.monitor.get(n).prefills)))

    def pick_offline_decode(
        self, relaxed_name: str, context_tokens: int, req_id: str | None = None
    ) -> OfflineDecodeChoice:
        choice = self.policy.select_offline_decode(relaxed_name, context_tokens, self.strict())
        self.counters["offline_decodes_strict" if choice.strict else "offline_decodes_relaxed"] += 1
        self.last_choice = choice
        if choice.strict and req_id is not None:
            self.prefilled_on[req_id] = (relaxed_name, time.monotonic())
        return choice

    # ------------------------------------------------------------------ evictions

    async def run(self) -> None:
        """Periodically move offline decodes off strict instances that stopped holding the SLO."""
        while True:
            await asyncio.sleep(REBALANCE_S)
            await self.rebalance()

    async def rebalance(self) -> int:
        """One check (``ColocationPolicy.select_evictions``); the number of moves started."""
        if self._evictions is None:
            return 0
        self._forget_old()
        relaxed, moved = self.relaxed(), 0
        for ev in self.policy.select_evictions(self.strict()):
            home = self.prefilled_on.get(ev.req_id, ("", 0.0))[0]
            to = home if home in relaxed else self.pick_offline_prefill(count=False)
            if to is None:
                break  # no relaxed instance to go back to
            if await self._evictions.evict(ev.req_id, to):
                moved += 1
                self.counters["offline_evictions"] += 1
                self.last_eviction = ev
                self.prefilled_on.pop(ev.req_id, None)
        return moved

    def _forget_old(self) -> None:
        cutoff = time.monotonic() - PREFILLED_ON_TTL_S
        for req_id in [r for r, (_, t) in self.prefilled_on.items() if t < cutoff]:
            del self.prefilled_on[req_id]

    # ------------------------------------------------------------------ admin

    def view(self) -> dict[str, Any]:
        last = self.last_choice
        return {
            "enabled": True,
            "tpot_slo_ms": self.policy.tpot_slo_s * 1000,
            "headroom": self.policy.headroom,
            "pools": {"latency_relaxed": self.relaxed(), "latency_strict": [s.name for s in self.strict()]},
            **self.counters,
            "last_offline_decode": None if last is None else {"instance": last.name, "reason": last.reason},
            "last_eviction": None
            if self.last_eviction is None
            else {"instance": self.last_eviction.instance, "reason": self.last_eviction.reason},
        }

    def instance_view(self, name: str) -> dict[str, Any]:
        model = self.models.get(name)
        if model is None:
            return {}
        mon = self.monitor.get(name)
        offline = sum(1 for r in mon.decodes if r in mon.offline)
        return {
            "colocation": {
                "roofline": model.state(),
                "bottleneck": model.bottleneck(len(mon.decodes), sum(mon.decodes.values())),
                "num_offline_decoding": offline,
                "num_online_decoding": len(mon.decodes) - offline,
            }
        }
