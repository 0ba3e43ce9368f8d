"""Pure, I/O-free service policies over snapshots: routing, PD pairing, dynamic PD, engine restarts."""

from xservice.policies.dynamic_pd import SLO, DynamicPDPolicy, Flip, FlipHistory, PDInstance
from xservice.policies.pd import PDPair, PDPolicy
from xservice.policies.predictors import TPOTPredictor, TTFTPredictor
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
    "SLO",
    "DECODE_ROLES",
    "DynamicPDPolicy",
    "Flip",
    "FlipHistory",
    "PDInstance",
    "TPOTPredictor",
    "TTFTPredictor",
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
