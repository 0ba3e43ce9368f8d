"""The discrete-event cluster: simulated instances (``instance.py``) placed by the service's own policy
classes, unchanged -- the service's routing policy for colocated instances (``cluster.routing.policy``,
default ``cache_aware``), ``PDPolicy`` for a static P/D split, ``DynamicPDPolicy`` (SLO-aware placement
and role flips) for dynamic PD, with its TTFT / TPOT predictors seeded from the device profile. Each
policy sees what the service gives it: the blocks of the prompt each instance's prefix cache holds
(cache-aware routing), the uncached tokens per instance (dynamic PD).

Events: arrivals, step completions, KV transfers ending (``kv_bytes_per_token`` over
``transfer_gbps``), and the flip planner's tick. With many instances a policy is shown the
``shortlist`` best candidates by its own first sort key (least load, least queued, fewest decode
tokens) rather than all of them, plus the least loaded of the instances holding the prompt's prefix
(the global KV index), which keeps a placement O(shortlist); every instance is shown up to that many.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from benchmarks.cluster_sim.colocation import OfflineColocation
from benchmarks.cluster_sim.instance import SimInstance
from benchmarks.cluster_sim.trace import SimRequest
from ops.platforms.device_profile import DeviceProfile
from xservice.policies.dynamic_pd import DECODE, PREFILL, SLO, DynamicPDPolicy, FlipHistory, PDInstance
from xservice.policies.pd import PDPolicy
from xservice.policies.predictors import TPOTPredictor, TTFTPredictor
from xservice.policies.routing import InstanceSnapshot, RouteRequest, make_policy

MODES = ("colocated", "static", "dynamic")
_ARRIVE, _STEP, _JOIN, _TICK = 0, 1, 2, 3


@dataclass
class SimConfig:
    mode: str
    num_instances: int
    num_prefill: int = 0  # static / dynamic: instances launched as prefill
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    budget: int = 2048  # max_num_batched_tokens
    max_seqs: int = 256
    tick_s: float = 0.5  # the flip planner's period
    shortlist: int = 16
    step_host_ms: float = 0.0  # an engine's host work per step (scheduling, sampling, outputs)
    request_overhead_ms: float = 0.0  # a request's way in (HTTP, tokenizing, routing) before it queues
    handoff_ms: float = 0.0  # a P/D hand-off beyond its transfer (export, import, the decode's way in)
    cores: float = 0.0  # the instances share this many cores (0: each its own device)
    routing: str = "cache_aware"  # colocated placement (the service's cluster.routing.policy)
    colocation: bool = False  # P/D modes: offline requests co-located by ``ColocationPolicy``
    block_size: int = 16  # prefix-cache blocks
    policy: dict = field(default_factory=dict)  # DynamicPDPolicy keyword arguments


@dataclass
class RequestRecord:
    req: SimRequest
    first_token: float | None = None
    end: float | None = None


def seeded_predictors(profile: DeviceProfile) -> tuple[TTFTPredictor, TPOTPredictor]:
    """TTFT and TPOT predictors fitted to ``profile`` over a grid (what the service seeds at start-up)."""
    ttft, tpot = TTFTPredictor(), TPOTPredictor()
    for tokens in (16, 128, 512, 1024, 2048, 4096, 8192):
        ttft.observe(tokens, profile.step_seconds([tokens], [tokens]), seed=True)
    for batch in (1, 8, 32, 128):
        for ctx in (256, 2048):
            s = profile.step_seconds([1] * batch, [ctx] * batch)
            tpot.observe(batch, batch * ctx, s, seed=True)
            p = profile.step_seconds([1] * batch + [512], [ctx] * batch + [512])
            tpot.observe(batch, batch * ctx, p, prefill_tokens=512, seed=True)
    return ttft, tpot


class Cluster:
    def __init__(self, config: SimConfig, profile: DeviceProfile) -> None:
        if config.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        n, p = config.num_instances, config.num_prefill
        if config.mode != "colocated" and not 0 < p < n:
            raise ValueError("a P/D split needs 1 <= num_prefill < num_instances")
        if config.colocation and config.mode == "colocated":
            raise ValueError("online/offline co-location needs a P/D split (static or dynamic)")
        self.config, self.profile = config, profile
        role = lambda i: "mixed" if config.mode == "colocated" else (PREFILL if i < p else DECODE)  # noqa: E731
        self.instances = [
            SimInstance(
                i,
                profile,
                role(i),
                config.budget,
                config.max_seqs,
                host_ms=config.step_host_ms,
                block_size=config.block_size,
            )
            for i in range(n)
        ]
        self.slo = SLO(config.ttft_slo_s, config.tpot_slo_s)
        self.ttft, self.tpot = seeded_predictors(profile)
        self.dynamic = DynamicPDPolicy(**config.policy) if config.mode == "dynamic" else None
        self.history = FlipHistory()
        self.static, self.colocated = PDPolicy(), make_policy(config.routing)
        self.holders: dict[int, set[int]] = {}  # prefix group -> instances caching it (the KV index)
        self.coloc = OfflineColocation(self, config.tpot_slo_s) if config.colocation else None
        self.joining: dict[int, SimRequest] = {}  # evicted decodes on their way: what is left of each
        self.events: list[tuple[float, int, int, int, int]] = []
        self._seq = itertools.count()
        self.records: dict[int, RequestRecord] = {}
        self.now = 0.0
        self.num_flips = 0
        self.num_busy = 0  # instances with a step in flight
        self.transfer_bps = profile.transfer_gbps * 1e9 / 8 if profile.transfer_gbps else 0.0
        # the shortlists' sort keys, kept current per instance (``_sync``)
        self.inflight = np.zeros(n)
        self.queued = np.zeros(n)
        self.context = np.zeros(n)
        self.prefill_role = np.array([i.role == PREFILL for i in self.instances])

    # ------------------------------------------------------------------ the loop
    def run(self, trace: list[SimRequest]) -> dict[int, RequestRecord]:
        arrivals = iter(trace)
        first = next(arrivals, None)
        delay = self.config.request_overhead_ms / 1000
        if first is not None:
            self._push(first.arrival + delay, _ARRIVE, first.rid)
            self.records[first.rid] = RequestRecord(first)
        if self.dynamic is not None or self.coloc is not None:
            self._push(self.config.tick_s, _TICK, 0)
        pending = len(trace)
        while self.events and pending:
            self.now, _, kind, a, b = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self._arrive(self.records[a].req)
                nxt = next(arrivals, None)
                if nxt is not None:
                    self.records[nxt.rid] = RequestRecord(nxt)
                    self._push(nxt.arrival + delay, _ARRIVE, nxt.rid)
            elif kind == _STEP:
                pending -= self._step_done(self.instances[a])
            elif kind == _JOIN:
                inst = self.instances[a]
                inst.add_decode(self.joining.pop(b, None) or self.records[b].req)
                self._kick(inst)
            else:
                if self.dynamic is not None:
                    self._plan_flips()
                if self.coloc is not None:
                    self.coloc.plan_evictions()
                self._push(self.now + self.config.tick_s, _TICK, 0)
        return self.records

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, a, b))

    def _sync(self, inst: SimInstance) -> None:
        j = inst.index
        self.inflight[j], self.queued[j], self.context[j] = (
            inst.num_inflight,
            inst.queued_tokens,
            inst.ctx_sum,
        )

    def _kick(self, inst: SimInstance) -> None:
        self._sync(inst)
        if not inst.busy and inst.has_work:
            self.num_busy += 1
            # shared cores: a step starting beside others runs that much slower (processor sharing,
            # priced once at its start)
            slowdown = max(1.0, self.num_busy / self.config.cores) if self.config.cores else 1.0
            self._push(self.now + inst.start_step(self.now, slowdown), _STEP, inst.index)

    # ------------------------------------------------------------------ requests
    def _arrive(self, req: SimRequest) -> None:
        mode = self.config.mode
        if mode == "colocated":
            shown = self._snapshots(None, req)
            block = self.config.block_size
            matched = {s.name: self.by_name(s.name).matched_tokens(req) // block for s in shown}
            route = RouteRequest(req.prompt // block, {k: v for k, v in matched.items() if v})
            inst = self.by_name(self.colocated.select(route, shown))
            inst.add_prefill(req, True, req.prompt + req.output)
        elif req.offline and self.coloc is not None:
            inst = self.coloc.pick_prefill()
            inst.add_prefill(req, False, req.prompt)
        elif mode == "static":
            inst = self.by_name(self.static.select_prefill(self._snapshots(self.prefill_role)))
            inst.add_prefill(req, False, req.prompt)
        else:
            assert self.dynamic is not None
            views = self._pd_views(prefill=True, req=req)
            uncached = {v.name: req.prompt - self.by_name(v.name).matched_tokens(req) for v in views}
            choice = self.dynamic.select_prefill(uncached, self.slo, views, self.history, self.now)
            if choice.flip is not None:
                self._flip(choice.flip)
            inst = self.by_name(choice.name)
            inst.add_prefill(req, False, req.prompt)
        inst.num_inflight += 1
        self._kick(inst)

    def _step_done(self, inst: SimInstance) -> int:
        """Apply ``inst``'s step; returns how many requests ended."""
        done, ended = inst.finish_step(), 0
        self.num_busy -= 1
        for rid in done.decoded:
            rec = self.records[rid]
            rec.end = self.now
            inst.forget_decoded(rid)
            inst.num_inflight -= 1
            ended += 1
        for p in done.prefilled:
            rec = self.records[p.req.rid]
            rec.first_token = self.now
            if p.req.output <= 1:  # the first token was the last
                rec.end = self.now
                inst.release(p.reserve)
                inst.num_inflight -= 1
                ended += 1
            elif not p.decode_here:
                ended += self._hand_off(inst, p.req, p.reserve)
            self._remember(inst, p.req)  # after its KV left or was released: the room it has now
        for left in done.moved:
            assert self.coloc is not None
            self._move(inst, self.coloc.home_of(left.rid), left)
        self._kick(inst)
        return ended

    def _move(self, source: SimInstance, target: SimInstance, req: SimRequest) -> None:
        """``req``'s KV (its prompt: the context so far) moves from ``source`` to decode on ``target``."""
        source.num_inflight -= 1
        target.num_inflight += 1
        self._sync(target)
        if target is source:
            source.add_decode(req)
            return
        self.joining[req.rid] = req
        delay = self._transfer_s(req.prompt) + self.config.handoff_ms / 1000
        self._push(self.now + delay, _JOIN, target.index, req.rid)

    def _transfer_s(self, tokens: int) -> float:
        return tokens * self.profile.kv_bytes_per_token / self.transfer_bps if self.transfer_bps else 0.0

    def _remember(self, inst: SimInstance, req: SimRequest) -> None:
        """``inst`` caches ``req``'s group prefix; the KV index follows what it evicted for room."""
        for group in inst.remember(req):
            self.holders.get(group, set()).discard(inst.index)
        if req.group >= 0 and inst.cached.get(req.group):
            self.holders.setdefault(req.group, set()).add(inst.index)

    def _hand_off(self, inst: SimInstance, req: SimRequest, reserved: int) -> int:
        """A prompt prefilled on a prefill-side instance: decode it there or move its KV."""
        if req.offline and self.coloc is not None:
            target = self.coloc.place_decode(inst, req)
        else:
            target = self._decode_target(inst, req)
        inst.release(reserved)
        self._move(inst, target, req)
        return 0

    def _decode_target(self, inst: SimInstance, req: SimRequest) -> SimInstance:
        if self.dynamic is None:
            return self.by_name(
                self.static.select_decode(RouteRequest(), self._snapshots(~self.prefill_role))
            )
        views = self._pd_views(prefill=False, keep=inst)
        choice = self.dynamic.select_decode(
            inst.name, req.prompt + 1, self.slo, views, req.prompt + req.output
        )
        return self.by_name(choice.name) if choice.name is not None else inst

    # ------------------------------------------------------------------ flips
    def _plan_flips(self) -> None:
        assert self.dynamic is not None
        for flip in self.dynamic.plan_flips(self.slo, self._pd_views(all_=True), self.history, self.now):
            self._flip(flip)

    def _flip(self, flip) -> None:
        inst = self.by_name(flip.name)
        inst.role, inst.last_flip_at = flip.to_role, self.now
        self.prefill_role[inst.index] = flip.to_role == PREFILL
        self.history.record(flip, self.now)
        self.num_flips += 1

    # ------------------------------------------------------------------ what the policies see
    def by_name(self, name: str | None) -> SimInstance:
        assert name is not None
        return self.instances[int(name[1:])]

    def strict_shortlist(self) -> list[SimInstance]:
        """The decode-role instances with the fewest context tokens (what an offline decode is offered)."""
        return self._shortlist(~self.prefill_role, self.context)

    def _shortlist(
        self, mask: np.ndarray | None, keys: np.ndarray, k: int | None = None
    ) -> list[SimInstance]:
        """The instances of ``mask`` (None: all) with the ``k`` smallest ``keys``."""
        k = k or self.config.shortlist
        idx = np.arange(len(self.instances)) if mask is None else np.flatnonzero(mask)
        if len(idx) > k:
            idx = idx[np.argpartition(keys[idx], k - 1)[:k]]
        return [self.instances[j] for j in idx]

    def _holding(self, req: SimRequest | None, mask: np.ndarray | None) -> list[SimInstance]:
        """The least loaded ``shortlist`` of the instances of ``mask`` caching ``req``'s prefix."""
        held = self.holders.get(req.group) if req is not None and req.group >= 0 else None
        if not held:
            return []
        idx = np.fromiter(held, dtype=int)
        if mask is not None:
            idx = idx[mask[idx]]
        k = self.config.shortlist
        if len(idx) > k:
            idx = idx[np.argpartition(self.inflight[idx], k - 1)[:k]]
        return [self.instances[j] for j in idx]

    def _snapshots(self, mask: np.ndarray | None, req: SimRequest | None = None) -> list[InstanceSnapshot]:
        short = {i.index: i for i in self._shortlist(mask, self.inflight) + self._holding(req, mask)}
        return [InstanceSnapshot(i.name, i.role, num_inflight=i.num_inflight) for i in short.values()]

    def _pd_views(
        self,
        prefill: bool = False,
        keep: SimInstance | None = None,
        all_: bool = False,
        req: SimRequest | None = None,
    ) -> list[PDInstance]:
        """What the dynamic policy sees: to place a prompt, the least-queued prefill side and the decode
        side it may borrow from; to place a decode, the lightest decode side and ``keep``; every
        instance for the flip planner."""
        if all_:
            return [self._pd_view(i) for i in self.instances]
        k = self.config.shortlist
        p_side = self._shortlist(self.prefill_role, self.queued, k if prefill else 1)
        d_side = self._shortlist(~self.prefill_role, self.context, k if not prefill else k // 2)
        chosen = {i.name: i for i in p_side + d_side + self._holding(req, self.prefill_role)}
        if keep is not None:
            chosen[keep.name] = keep
        return [self._pd_view(i) for i in chosen.values()]

    def _pd_view(self, inst: SimInstance) -> PDInstance:
        window = self.dynamic.idle_s if self.dynamic is not None else 1.0
        util = min(1.0, inst.prefill_busy_window(self.now, window) / window)
        observed = inst.last_decode_step_s
        if observed is not None and observed > self.slo.tpot_s:
            inst.busy_since = inst.busy_since if inst.busy_since is not None else self.now
        else:
            inst.busy_since = None
        return PDInstance(
            name=inst.name,
            origin=inst.origin,
            role=inst.role,
            queue_s=self.ttft.compute_s(inst.queued_tokens) if inst.queued_tokens else 0.0,
            num_prefilling=len(inst.queue) + len(inst.waiting),
            num_decoding=inst.num_decoding,
            decode_tokens=inst.ctx_sum,
            reserved_tokens=inst.reserved,
            capacity_tokens=inst.capacity,
            observed_step_s=observed if inst.num_decoding else None,
            prefill_utilization=util,
            busy_since=inst.busy_since,
            last_flip_at=inst.last_flip_at,
            ttft=self.ttft,
            tpot=self.tpot,
        )
