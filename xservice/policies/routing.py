"""Routing policies: pick one instance for a request from snapshots (no I/O, deterministic).

The caller passes only the candidates that may serve the request (healthy, right role), each with
its load, and the request's prefix-cache match per instance (leading prompt blocks it holds).

- ``round_robin``: the next candidate after the last pick, in name order.
- ``least_load``: the lowest load; ties to the name.
- ``cache_aware`` (MiMo §3.1 / xLLM §3.4): ``score = match_weight * matched_fraction - normalized_load``,
  highest wins; ties to the lower load, then the name. With KV tiers (``docs/kv_tiers.md``) a prefix an
  instance holds in L2 or L3 counts too, each block discounted by its price: the instance's measured
  load time of a block from that tier over its measured time to compute one (``tier_cost``).

Load is ``max(num_inflight, num_running + num_waiting)``: what this service routed and has not seen
finish (exact, immediate), or what the engine last reported (includes other services' work).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Role groups in order of preference: the first group with a healthy instance is routed to.
PLAIN_ROLES: tuple[tuple[str, ...], ...] = (("mixed",), ("decode",), ("prefill",))
DECODE_ROLES: tuple[tuple[str, ...], ...] = (("decode",), ("mixed",), ("prefill",))


@dataclass(frozen=True)
class InstanceSnapshot:
    name: str
    role: str = "mixed"
    num_inflight: int = 0  # service side: routed here and not finished
    num_running: int = 0  # engine side, from the last heartbeat
    num_waiting: int = 0
    kv_usage: float = 0.0
    lora_adapters: frozenset[str] = frozenset()  # LoRA adapters in its device slots (last heartbeat)

    @property
    def load(self) -> int:
        return max(self.num_inflight, self.num_running + self.num_waiting)


@dataclass(frozen=True)
class RouteRequest:
    num_blocks: int = 0  # full prompt blocks
    matched_blocks: Mapping[str, int] | None = None  # instance -> leading blocks it holds
    # KV tiers: instance -> leading blocks it holds in L1 or L2, and in any tier (L3: its disk, the store)
    tier_blocks: Mapping[str, tuple[int, int]] | None = None
    # instance -> what loading one L2 / L3 block costs as a fraction of computing it (0: free as an L1 hit)
    tier_cost: Mapping[str, tuple[float, float]] | None = None
    lora_name: str | None = None  # the request's LoRA adapter: instances holding it in a slot are preferred


def has_adapter(request: RouteRequest, c: InstanceSnapshot) -> bool:
    """Whether ``c`` holds the request's adapter in a device slot (a base-model request: every one does)."""
    return request.lora_name is None or request.lora_name in c.lora_adapters


DEFAULT_TIER_COST = (0.05, 0.25)  # (L2, L3) before an instance has measured its loads and prefills


def tier_cost(
    load_ms_per_block: float | None, prefill_ms_per_token: float | None, block_size: int, default: float
) -> float:
    """A tier hit's price: measured load time of a block over the measured time to compute one (0..1);
    ``default`` until both are measured."""
    if not load_ms_per_block or not prefill_ms_per_token:
        return default
    return min(1.0, load_ms_per_block / (prefill_ms_per_token * block_size))


def effective_blocks(request: RouteRequest, name: str) -> float:
    """Leading prompt blocks an instance need not compute, L2 and L3 hits discounted by their price."""
    l1 = (request.matched_blocks or {}).get(name, 0)
    tiers = (request.tier_blocks or {}).get(name)
    if tiers is None:
        return float(l1)
    l2, l3 = max(tiers[0], l1), max(tiers[1], tiers[0], l1)
    c2, c3 = (request.tier_cost or {}).get(name, DEFAULT_TIER_COST)
    return l1 + (l2 - l1) * (1.0 - c2) + (l3 - l2) * (1.0 - c3)


class BaseRoutingPolicy(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def select(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> str:
        """The chosen instance's name; ``candidates`` is non-empty."""


def _check(candidates: Sequence[InstanceSnapshot]) -> list[InstanceSnapshot]:
    if not candidates:
        raise ValueError("no candidate instances to route to")
    return sorted(candidates, key=lambda c: c.name)


class RoundRobinPolicy(BaseRoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def select(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> str:
        ordered = _check(candidates)
        pick = next((c for c in ordered if self._last is None or c.name > self._last), ordered[0])
        self._last = pick.name
        return pick.name


class LeastLoadPolicy(BaseRoutingPolicy):
    name = "least_load"

    def select(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> str:
        key = lambda c: (c.load, not has_adapter(request, c), c.kv_usage, c.name)  # noqa: E731
        return min(_check(candidates), key=key).name


class CacheAwarePolicy(BaseRoutingPolicy):
    name = "cache_aware"

    def __init__(self, match_weight: float = 2.0, lora_weight: float = 0.5) -> None:
        self.match_weight = match_weight
        self.lora_weight = lora_weight  # an adapter already in a slot: worth half an idle instance

    def scores(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> dict[str, float]:
        ordered = _check(candidates)
        max_load = max(c.load for c in ordered)
        out = {}
        for c in ordered:
            frac = effective_blocks(request, c.name) / request.num_blocks if request.num_blocks else 0.0
            norm_load = c.load / max_load if max_load > 0 else 0.0
            out[c.name] = (
                self.match_weight * frac
                - norm_load
                + self.lora_weight * (request.lora_name in c.lora_adapters)
            )
        return out

    def select(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> str:
        scores = self.scores(request, candidates)
        return min(_check(candidates), key=lambda c: (-scores[c.name], c.load, c.name)).name


POLICIES = ("round_robin", "least_load", "cache_aware")


def make_policy(name: str, match_weight: float = 2.0) -> BaseRoutingPolicy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy(match_weight)
    raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(POLICIES)}")
