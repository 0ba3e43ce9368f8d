"""Cache-aware routing with KV tiers (``docs/kv_tiers.md``): a prompt's leading blocks each instance
holds in L1, L2 (its host tier) and L3 (its disk, the shared store), with each instance's measured price
of an L2 / L3 hit, for ``CacheAwarePolicy`` (``xservice/policies/routing.py``) to weigh."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xservice.cluster.registry import InstanceRegistry
from xservice.cluster.remote_engine import RemoteEngineClient
from xservice.policies.routing import DEFAULT_TIER_COST, RouteRequest, tier_cost


def tier_route(
    hashes: Sequence[int],
    matched: Mapping[str, int],
    clients: Mapping[str, RemoteEngineClient],
    registry: InstanceRegistry,
    block_size: int,
) -> RouteRequest:
    """The route request for a prompt of chained block ``hashes`` whose L1 match is ``matched``."""
    tiered = {n: c.info.kv_tiers for n, c in clients.items() if c.info.kv_tiers}
    if not tiered:
        return RouteRequest(num_blocks=len(hashes), matched_blocks=matched)
    stores = {n for n, tiers in tiered.items() if "store" in tiers}
    costs = {}
    for name in tiered:
        state = registry.instances.get(name)
        load = state.load if state is not None else None
        per_block = load.tier_block_load_ms if load is not None else {}
        token_ms = load.prefill_token_ms if load is not None else None
        l3 = max((per_block.get(t, 0.0) for t in ("disk", "store")), default=0.0)
        costs[name] = (
            tier_cost(per_block.get("host"), token_ms, block_size, DEFAULT_TIER_COST[0]),
            tier_cost(l3, token_ms, block_size, DEFAULT_TIER_COST[1]),
        )
    tiers = registry.tier_index.match(hashes, matched, tiered, stores)
    return RouteRequest(len(hashes), dict(matched), tier_blocks=tiers, tier_cost=costs)
