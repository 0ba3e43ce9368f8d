"""Pure, I/O-free service policies over snapshots: routing and PD pairing."""

from xservice.policies.pd import PDPair, PDPolicy
from xservice.policies.routing import (
    DECODE_ROLES,
    PLAIN_ROLES,
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
    "DECODE_ROLES",
    "PLAIN_ROLES",
    "POLICIES",
    "BaseRoutingPolicy",
    "CacheAwarePolicy",
    "InstanceSnapshot",
    "LeastLoadPolicy",
    "PDPair",
    "PDPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "make_policy",
]
