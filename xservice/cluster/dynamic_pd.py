"""``DynamicPD``: the service side of dynamic PD disaggregation (xLLM report §3.2).

It owns the ``RoleTable`` (roles in the metadata store), the ``RuntimeMonitor`` (predictors and
the live view of each instance) and the pure ``DynamicPDPolicy``, and answers the PD dispatcher's
two questions: where a request prefills (possibly flipping a decode instance to prefill first) and
where it decodes (the prefill instance itself, or a decode instance). A background task asks the
policy every ``FLIP_CHECK_S`` whether to flip a prefill instance to decode. A flip only changes
the service-side role: the instance keeps running, in-flight prefills and decodes finish where
they are, and the next routing decision already sees the new pools.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from xengine.api.messages import AddRequest
from xservice.cluster.monitor import RuntimeMonitor, capacity_tokens
from xservice.cluster.profiling import profile_instance
from xservice.cluster.remote_engine import RemoteEngineClient
from xservice.cluster.roles import RoleTable
from xservice.policies.dynamic_pd import (
    DECODE,
    POOLS,
    SLO,
    DecodeChoice,
    DynamicPDPolicy,
    Flip,
    FlipHistory,
    PDInstance,
    PrefillChoice,
    pool_of,
)

logger = logging.getLogger(__name__)

FLIP_CHECK_S = 0.25


class DynamicPD:
    def __init__(
        self,
        roles: RoleTable,
        policy: DynamicPDPolicy,
        slo: SLO,
        monitor: RuntimeMonitor,
        profile: bool = True,
    ) -> None:
        self.roles = roles
        self.policy = policy
        self.slo = slo
        self.monitor = monitor
        self.profile = profile
        self.history = FlipHistory()
        self.num_flips: dict[str, int] = {"P→D": 0, "D→P": 0}
        self.profiles: dict[str, Any] = {}  # name -> last ProfileResult
        self.on_flip: list[Callable[[Flip], None]] = []
        self._clients: Callable[[], dict[str, RemoteEngineClient]] = dict
        self._healthy: Callable[[], list[str]] = list
        self._tasks: set[asyncio.Task] = set()
        self._host_locks: dict[str, asyncio.Lock] = {}  # instances on one host profile one at a time

    def attach(
        self, clients: Callable[[], dict[str, RemoteEngineClient]], healthy: Callable[[], list[str]]
    ) -> None:
        """Give the controller the pool's live clients and its healthy instance names."""
        self._clients, self._healthy = clients, healthy

    # ------------------------------------------------------------------ instances

    def instance_joined(self, client: RemoteEngineClient) -> None:
        """A (re)started instance answers: its pool is its stored role, else its launch role."""
        origin = client.record.role if client.record.role in ("prefill", "decode") else DECODE
        self.roles.ensure(client.name, origin)
        mon = self.monitor.get(client.name)
        mon.capacity_tokens = capacity_tokens(msgspec_info(client))
        self._spawn(self.roles.flush())
        if self.profile:
            self._spawn(self._profile(client))

    async def _profile(self, client: RemoteEngineClient) -> None:
        """Seed ``client``'s predictors. Instances sharing a host are profiled one after another: run
        side by side they would slow each other, and the seeds would stay pessimistic in the fits."""
        host = urlparse(client.record.input_addr).hostname or ""
        lock = self._host_locks.setdefault(host, asyncio.Lock())
        try:
            async with lock:
                self.profiles[client.name] = await profile_instance(
                    client, self.monitor.get(client.name), seed=len(self.profiles)
                )
        except Exception as e:  # noqa: BLE001 - the instance died meanwhile: online samples will do
            logger.warning("start-up profiling of %s failed (%s)", client.name, e)

    def role(self, name: str) -> str | None:
        return self.roles.role(name)

    def snapshots(self, now: float | None = None) -> list[PDInstance]:
        now = time.monotonic() if now is None else now
        out = []
        for name in self._healthy():
            rec = self.roles.records.get(name)
            if rec is not None:
                last = self.roles.flipped_at.get(name)
                out.append(self.monitor.snapshot(name, rec.origin, rec.role, last, now))
        return out

    # ------------------------------------------------------------------ decisions

    def slo_for(self, req: AddRequest) -> SLO:
        slo = getattr(req, "slo", None)
        if slo is None:
            return self.slo
        return SLO(
            slo.ttft_ms / 1000 if slo.ttft_ms is not None else self.slo.ttft_s,
            slo.tpot_ms / 1000 if slo.tpot_ms is not None else self.slo.tpot_s,
        )

    def pick_prefill(
        self, req: AddRequest, uncached: dict[str, int], exclude: str | None = None
    ) -> PrefillChoice:
        now = time.monotonic()
        instances = [i for i in self.snapshots(now) if i.name != exclude]
        choice = self.policy.select_prefill(uncached, self.slo_for(req), instances, self.history, now)
        if choice.flip is not None:
            self.apply(choice.flip, now)
        return choice

    def pick_decode(self, req: AddRequest, prefill_name: str | None, context_tokens: int) -> DecodeChoice:
        """Where ``req`` decodes; the choice holds the KV ``req`` may grow to there until
        ``monitor.release_decode(req.req_id)`` (the dispatcher calls it when the request ends)."""
        reserve = reserve_tokens(req, context_tokens)
        choice = self.policy.select_decode(
            prefill_name, context_tokens, self.slo_for(req), self.snapshots(), reserve
        )
        if choice.name is not None:
            self.monitor.reserve_decode(choice.name, req.req_id, context_tokens, reserve)
        return choice

    def apply(self, flip: Flip, now: float | None = None) -> None:
        """Move the instance to its new pool now; persist in the background."""
        now = time.monotonic() if now is None else now
        rec = self.roles.records[flip.name]
        before = pool_of(rec.origin, rec.role)
        self.roles.flip(flip.name, flip.to_role, flip.reason)
        self.monitor.role_changed(flip.name)
        self.history.record(flip, now)
        self.num_flips[flip.direction] += 1
        logger.info("flip %s: %s -> %s (%s)", flip.name, before, pool_of(rec.origin, rec.role), flip.reason)
        for listener in self.on_flip:
            listener(flip)
        self._spawn(self.roles.flush())

    def manual_flip(self, name: str, to_role: str, reason: str = "", source: str = "operator") -> Flip:
        """An operator's flip (``POST /v1/admin/instances/{name}/role``), or another controller's
        (``source``: PrfaaS's re-planning): no hysteresis, but never below ``min_prefill`` /
        ``min_decode``. Raises ``KeyError`` (unknown instance) or ``ValueError``."""
        if to_role not in ("prefill", "decode"):
            raise ValueError("role must be 'prefill' or 'decode'")
        healthy = self._healthy()
        if name not in self.roles.records or name not in healthy:
            raise KeyError(name)
        current = self.roles.records[name].role
        if current == to_role:
            raise ValueError(f"instance {name!r} already serves as {to_role}")
        side = sum(1 for n in healthy if self.roles.role(n) == current)
        minimum = self.policy.min_prefill if current == "prefill" else self.policy.min_decode
        if side - 1 < minimum:
            raise ValueError(f"flipping {name!r} would leave fewer than {minimum} {current} instance(s)")
        flip = Flip(name, to_role, f"{source}: {reason}" if reason else source)
        self.apply(flip)
        return flip

    async def run(self) -> None:
        """Periodic flip planning (prefill → decode on TPOT misses or prefill idleness)."""
        while True:
            await asyncio.sleep(FLIP_CHECK_S)
            now = time.monotonic()
            for flip in self.policy.plan_flips(self.slo, self.snapshots(now), self.history, now):
                self.apply(flip, now)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ admin

    def pools(self) -> dict[str, list[str]]:
        healthy = set(self._healthy())
        out: dict[str, list[str]] = {p: [] for p in POOLS}
        for name, rec in sorted(self.roles.records.items()):
            if name in healthy:
                out[pool_of(rec.origin, rec.role)].append(name)
        return out

    def view(self) -> dict[str, Any]:
        p = self.policy
        return {
            "enabled": True,
            "slo": {"ttft_ms": self.slo.ttft_s * 1000, "tpot_ms": self.slo.tpot_s * 1000},
            "min_decode": p.min_decode,
            "min_prefill": p.min_prefill,
            "cooldown_s": p.cooldown_s,
            "pools": self.pools(),
            "num_flips": dict(self.num_flips),
            "flips": self.roles.history(),
        }

    def instance_view(self, name: str) -> dict[str, Any]:
        rec = self.roles.records.get(name)
        out: dict[str, Any] = {}
        if rec is not None:
            out = {"origin": rec.origin, "role": rec.role, "pool": pool_of(rec.origin, rec.role)}
        profile = self.profiles.get(name)
        predictors = self.monitor.view(name, time.monotonic())
        if profile is not None:
            predictors["profile_s"] = round(profile.seconds, 3)
        return {**out, "num_flips": rec.num_flips if rec else 0, "predictors": predictors}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def reserve_tokens(req: AddRequest, context_tokens: int) -> int:
    """The KV ``req`` may grow to: its prompt plus ``max_tokens`` (its context alone when unbounded)."""
    max_tokens = req.params.max_tokens
    if max_tokens is None:
        return context_tokens
    return max(context_tokens, len(req.prompt_token_ids) + max_tokens)


def msgspec_info(client: RemoteEngineClient) -> dict:
    return dict(client.record.info)
