"""``PrfaasRouter`` (``xservice/cluster/prfaas/router.py``) over stand-in pools: where prompts prefill, a
prefix brought across in the abundant regime, the link meter driving the threshold, and re-planning
flipping a local instance through dynamic PD. The real clusters: ``test_cluster_prfaas.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from xservice.cluster.prfaas.config import PrfaasConfig
from xservice.cluster.prfaas.link import LinkMeter, transfer
from xservice.cluster.prfaas.router import PrfaasRouter
from xservice.policies import InstanceSnapshot, RouteRequest

PROFILES = Path(__file__).resolve().parents[3] / "benchmarks/cluster_sim/profiles/prfaas"
BLOCK = 16


@dataclass
class FakePool:
    roles: dict[str, str]
    matched: dict[str, int] = field(default_factory=dict)  # instance -> leading blocks it holds
    waiting: dict[str, int] = field(default_factory=dict)
    dynamic: object | None = None

    def __post_init__(self) -> None:
        self.clients = {n: SimpleNamespace(name=n, is_alive=True) for n in self.roles}
        self.info = SimpleNamespace(block_size=BLOCK)

    def snapshots(self) -> list[InstanceSnapshot]:
        return [
            InstanceSnapshot(n, r, num_waiting=self.waiting.get(n, 0)) for n, r in sorted(self.roles.items())
        ]

    def route_request(self, kv_ids: list[int]) -> RouteRequest:
        return RouteRequest(len(kv_ids) // BLOCK, dict(self.matched))


def _router(**cfg) -> tuple[PrfaasRouter, FakePool, FakePool]:
    remote = FakePool({"prfaas-0": "prefill", "prfaas-1": "prefill"})
    local = FakePool({"p0": "prefill", "d0": "decode", "d1": "decode"})
    conf = PrfaasConfig(enabled=True, threshold_tokens=1000, link_gbps=1.0, **cfg)
    return PrfaasRouter(conf, remote, local), remote, local


def test_long_uncached_prompts_go_to_prfaas() -> None:
    router, remote, _ = _router()
    assert router.pick(list(range(500)), 0).client is None
    choice = router.pick(list(range(3000)), 0)
    assert choice.client is remote.clients["prfaas-0"] and choice.prefix_from is None
    assert router.pick(list(range(3000)), 2500).client is None  # mostly cached locally: the increment
    assert router.counts["prfaas"] == 1 and router.counts["local"] == 2
    assert router.pick(list(range(3000)), 0, not_="prfaas-0").client is remote.clients["prfaas-1"]


def test_abundant_bandwidth_brings_the_prfaas_prefix_to_a_local_prefill() -> None:
    router, remote, _ = _router()
    remote.matched = {"prfaas-1": 2900 // BLOCK}
    choice = router.pick(list(range(3000)), 0)  # idle link: abundant
    assert choice.client is None and choice.prefix_from is remote.clients["prfaas-1"]
    router.scheduler.last = router.scheduler.last.__class__(
        **{**router.scheduler.last.__dict__, "bandwidth_scarce": True}
    )
    scarce = router.pick(list(range(3000)), 0)  # scarce: PrfaaS computes on its own cache
    assert scarce.client is not None and scarce.prefix_from is None


def test_a_backed_up_link_raises_the_threshold() -> None:
    router, _, _ = _router(tick_s=1.0, max_queue_s=2.0)
    for x in range(200):
        router.scheduler.record_length(500 + 20 * x)
    t0 = 100.0
    for _ in range(4):  # 3 s of transfers still in flight: a backlog past max_queue_s
        router.meter.begin(1e6, now=t0 - 3.0)
    router.sample(now=t0)
    assert router.threshold > 1000 and router.counts["threshold_raises"] == 1
    assert router.view()["history"][-1]["reason"] == "raise"
    local_full = _router(tick_s=1.0, max_queue_s=2.0)
    r2, _, loc = local_full
    loc.waiting = {"p0": 3}  # every local prefill instance has a queue: hold
    r2.meter.begin(1e6, now=t0 - 3.0)
    r2.sample(now=t0)
    assert r2.threshold == 1000


def test_link_meter_capacity_is_what_a_busy_link_delivered() -> None:
    m = LinkMeter(configured_gbps=1.0, window_s=10.0, min_busy_s=0.5)
    assert m.capacity_gbps(now=0.0) == 1.0
    for k in range(4):  # two at a time, each 1 MB over 2 s: 8 Mbit/s delivered
        tok = m.begin(1e6, now=float(k))
        m.end(tok, 1e6, 2.0, now=float(k) + 2.0)
    assert m.delivered_gbps(now=5.0) == pytest.approx(4e6 * 8 / 5.0 / 1e9)
    assert m.capacity_gbps(now=5.0) < 0.01 and m.queued_bytes == 0 and m.sent_bytes == 4e6
    with transfer(m, 5e5) as t:
        assert m.num_inflight == 1 and m.queued_bytes == 5e5
        t["bytes"], t["seconds"] = 0, 0  # a failed transfer: nothing sent
    assert m.num_inflight == 0 and m.sent_bytes == 4e6
    with transfer(None, 1.0) as t:
        assert t is None


def test_replan_sets_the_threshold_and_flips_toward_the_split() -> None:
    flips: list[tuple[str, str, str]] = []
    dynamic = SimpleNamespace(manual_flip=lambda n, r, reason, source: flips.append((n, r, source)))
    router, _, local = _router(
        plan_profiles=f"{PROFILES / 'emulated-prfaas.json'},{PROFILES / 'emulated-local.json'}"
    )
    local.dynamic = dynamic
    for x in range(300):
        router.scheduler.record_length(100 + (x * 37) % 900)
        router.finished(16)
    point = router.replan()
    assert point is not None and router.threshold == point.deployment.threshold
    # prefill-bound at 1P/2D (decode has room): the plan converts a decode instance
    assert point.bottleneck == "pd-p" and router.plan["recommended_split"] == {
        "prefill": 2,
        "decode": 1,
        "lambda_max_req_s": router.plan["recommended_split"]["lambda_max_req_s"],
    }
    assert router.rebalance() == "d0" and flips == [("d0", "prefill", "prfaas plan")]
    local.roles = {"p0": "prefill", "d0": "prefill", "d1": "decode"}
    router.replan()
    assert router.rebalance() is None and len(flips) == 1  # at the planned split: nothing to do
    assert router.counts["replans"] == 2 and router.counts["rebalances"] == 1


def test_prefixes_count_where_a_prefill_can_use_them() -> None:
    router, remote, local = _router()
    local.matched = {"d0": 2900 // BLOCK}  # a decode instance's imported blocks: no prefill starts there
    assert router.pick(list(range(3000)), 0).client is not None  # so the long prompt still offloads
    remote.matched = {"prfaas-1": 1000 // BLOCK}  # the PrfaaS instance holding part of it computes it
    assert router.pick(list(range(3000)), 0).client is remote.clients["prfaas-1"]
