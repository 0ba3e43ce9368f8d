"""Pure, I/O-free service policies over snapshots (routing; PD pairing comes with phase 2)."""

from xservice.policies.routing import (
    POLICIES,
    BaseRoutingPolicy,
    CacheAwarePolicy,
    InstanceSnapshot,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteRequest,
    make_policy,
)

__all__ = [
    "POLICIES",
    "BaseRoutingPolicy",
    "CacheAwarePolicy",
    "InstanceSnapshot",
    "LeastLoadPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "make_policy",
]
