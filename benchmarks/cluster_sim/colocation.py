"""Online/offline co-location in the simulator (xLLM report §3.1), placed by the service's own
``ColocationPolicy``, unchanged.

With ``SimConfig.colocation`` on a P/D cluster, an offline request (``SimRequest.offline``) prefills on
the relaxed (prefill-role) instance with the least queued, behind any online prompt there (the engine
stops an offline prefill between layers for an online arrival). Its decode goes where
``select_offline_decode`` puts it: a strict (decode-role) instance whose batch the TPOT predictor keeps
under the policy's headroom of the SLO with it (its KV moves there), else it stays where it prefilled.
Each planner tick, ``select_evictions`` moves offline decodes off strict instances whose batch no longer
holds the SLO, back to the relaxed instance they prefilled on, or the least queued relaxed one (the
service's ``rebalance``). The service continues a moved stream as prompt + tokens so far where its
prompt is still cached; the simulator moves its KV (the context) over the link instead.
Without co-location an offline request is placed like an online one; either way it has no latency SLO
and the results count it apart (``offline``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from benchmarks.cluster_sim.instance import SimInstance
from benchmarks.cluster_sim.trace import SimRequest
from xservice.policies.colocation import ColocationPolicy, StrictInstance
from xservice.policies.dynamic_pd import DECODE, PREFILL

if TYPE_CHECKING:
    from benchmarks.cluster_sim.cluster import Cluster


class OfflineColocation:
    def __init__(self, cluster: Cluster, tpot_slo_s: float) -> None:
        self.cluster = cluster
        self.policy = ColocationPolicy(tpot_slo_s)
        self.prefilled_on: dict[int, int] = {}  # offline request -> the relaxed instance it prefilled on
        self.counts = {"decodes_strict": 0, "decodes_relaxed": 0, "evictions": 0}

    def pick_prefill(self) -> SimInstance:
        """The relaxed instance with the least queued (the service's ``pick_offline_prefill``)."""
        relaxed = [i for i in self.cluster.instances if i.role == PREFILL]
        if not relaxed:  # none left (dynamic PD lent them all): as an online request
            return min(self.cluster.instances, key=lambda i: (i.queued_tokens, i.index))
        return min(relaxed, key=lambda i: (i.queued_tokens, len(i.queue), i.index))

    def place_decode(self, relaxed: SimInstance, req: SimRequest) -> SimInstance:
        """Where offline ``req``, prefilled on ``relaxed``, decodes."""
        self.prefilled_on[req.rid] = relaxed.index
        strict = self.cluster.strict_shortlist()
        choice = self.policy.select_offline_decode(relaxed.name, req.prompt + 1, self._views(strict))
        self.counts["decodes_strict" if choice.strict else "decodes_relaxed"] += 1
        return self.cluster.by_name(choice.name)

    def plan_evictions(self) -> None:
        """Offline decodes off strict instances over their SLO; each leaves when its step ends."""
        busy = [i for i in self.cluster.instances if i.role == DECODE and i.num_offline_decoding]
        if not busy or not any(i.role == PREFILL for i in self.cluster.instances):
            return  # nothing to move, or no relaxed instance to go back to
        for ev in self.policy.select_evictions(self._views(busy)):
            rid = int(ev.req_id)
            home = self.prefilled_on.get(rid)
            if home is None or self.cluster.instances[home].role != PREFILL:
                self.prefilled_on[rid] = self.pick_prefill().index  # (its home was lent to decode)
            self.cluster.by_name(ev.instance).evict(rid)
            self.counts["evictions"] += 1

    def home_of(self, rid: int) -> SimInstance:
        """Where an evicted offline decode goes: the relaxed instance it prefilled on, or the least
        queued relaxed one where that one is not relaxed any more (the service's ``rebalance``)."""
        return self.cluster.instances[self.prefilled_on.pop(rid)]

    def _views(self, strict: list[SimInstance]) -> list[StrictInstance]:
        return [
            StrictInstance(
                name=i.name,
                model=self.cluster.tpot,  # the TPOT predictor seeded from the profile
                num_online=i.num_decoding - i.num_offline_decoding,
                num_offline=i.num_offline_decoding,
                context_tokens=i.ctx_sum,
                capacity_tokens=i.capacity,
                offline=tuple((str(rid), ctx) for rid, ctx in i.offline_decodes())
                if i.num_offline_decoding
                else (),
                observed_step_s=i.last_decode_step_s if i.num_decoding else None,
            )
            for i in strict
        ]
