"""Pure, I/O-free service policies over snapshots: routing, PD pairing, engine restarts."""

from xservice.policies.pd import PDPair, PDPolicy
from xservice.policies.restart import RestartPolicy
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
    "RestartPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "make_policy",
]
