"""Routing LoRA requests: an instance holding the request's adapter in a device slot (its last
heartbeat's ``lora_adapters``) is preferred; base-model requests and every other signal are unchanged."""

from __future__ import annotations

from xservice.policies.routing import CacheAwarePolicy, InstanceSnapshot, LeastLoadPolicy, RouteRequest


def _pair(load_a: int = 0, load_b: int = 0) -> list[InstanceSnapshot]:
    return [
        InstanceSnapshot(name="a", num_running=load_a),
        InstanceSnapshot(name="b", num_running=load_b, lora_adapters=frozenset({"tenant1"})),
    ]


def test_cache_aware_prefers_the_instance_with_the_adapter() -> None:
    policy = CacheAwarePolicy()
    assert policy.select(RouteRequest(num_blocks=4, lora_name="tenant1"), _pair()) == "b"
    assert policy.select(RouteRequest(num_blocks=4, lora_name="tenant2"), _pair()) == "a"  # neither: the name
    assert policy.select(RouteRequest(num_blocks=4), _pair()) == "a"
    # the adapter is worth less than a cached prompt: a full prefix hit elsewhere still wins
    request = RouteRequest(num_blocks=4, matched_blocks={"a": 4}, lora_name="tenant1")
    assert policy.select(request, _pair()) == "a"
    # and less than an idle instance against a loaded one
    assert policy.select(RouteRequest(num_blocks=4, lora_name="tenant1"), _pair(0, 8)) == "a"


def test_least_load_breaks_ties_by_adapter() -> None:
    policy = LeastLoadPolicy()
    assert policy.select(RouteRequest(lora_name="tenant1"), _pair()) == "b"
    assert policy.select(RouteRequest(lora_name="tenant1"), _pair(0, 1)) == "a"
    assert policy.select(RouteRequest(), _pair()) == "a"
