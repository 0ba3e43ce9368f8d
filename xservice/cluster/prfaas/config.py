"""``cluster.prfaas``: the Prefill-as-a-Service cluster (docs/prfaas.md), each field once (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from xengine.api.config import _f


@dataclass(frozen=True)
class PrfaasConfig:
    """``cluster.prfaas``: a second cluster of prefill instances for long prompts."""

    enabled: bool = _f(
        False,
        "Prefill-as-a-Service: a second cluster of prefill instances (its own registry namespace, link and "
        "Mooncake endpoints); a request whose uncached prompt exceeds threshold_tokens prefills there and "
        "its KV crosses the link to a local decode instance (needs local prefill and decode instances). "
        "docs/prfaas.md.",
    )
    instances: str = _f(
        "",
        "PrfaaS prefill instances the service launches, comma-separated names (e.g. 'prfaas-0,prfaas-1'). "
        "Empty: serve those that register under key_prefix by themselves ('xllm engine --key-prefix ...').",
    )
    key_prefix: str = _f("/xllm-prfaas", "The PrfaaS cluster's registry namespace in the metadata store.")
    engine_host: str = _f(
        "",
        "Address the PrfaaS instances bind (their ZMQ and Mooncake endpoints: reachable from the service and "
        "the local decode instances). Empty: cluster.launch.engine_host.",
    )
    netns: str = _f(
        "",
        "Linux network namespace the service launches the PrfaaS instances in ('ip netns exec'; ci/netns.sh "
        "makes one joined by a shaped link). Empty: the service's own.",
    )
    store_host: str = _f(
        "",
        "Embedded store: the service's address on the link, where it serves its store to the PrfaaS "
        "instances (a second bridge). Empty: cluster.launch.engine_host.",
    )
    etcd_endpoint: str = _f(
        "",
        "Store etcd: etcd as the PrfaaS instances reach it, HOST:PORT. Empty: cluster.registry.etcd_endpoint.",
    )
    device_profile: str = _f(
        "",
        "Run the PrfaaS instances emulated with this device profile (a faster accelerator than the local "
        "instances', docs/emulated.md). Empty: the local instances' engine settings.",
    )
    threshold_tokens: int = _f(
        4096,
        "Routing threshold t: a request whose uncached prompt tokens exceed it prefills on the PrfaaS cluster "
        "('xllm plan prfaas' finds it; the scheduler moves it).",
    )
    link_gbps: float = _f(
        10.0,
        "The PrfaaS cluster's egress bandwidth B_out, Gbit/s: the scheduler's ceiling (lowered to what the "
        "link delivers when it runs busy and slower).",
    )
    scheduler: bool = _f(
        True,
        "Bandwidth-aware scheduler: raise the threshold near the link's ceiling or when its backlog grows, "
        "lower it back toward the planned one when the link idles.",
    )
    tick_s: float = _f(1.0, "Scheduler: how often it samples the link.")
    high_utilization: float = _f(0.85, "Scheduler: link utilisation at which the threshold rises.")
    low_utilization: float = _f(0.5, "Scheduler: link utilisation at or below which it comes back down.")
    max_queue_s: float = _f(5.0, "Scheduler: a link backlog of this many seconds raises the threshold.")
    plan_profiles: str = _f(
        "",
        "Long-term re-planning: 'PRFAAS_PROFILE,LOCAL_PROFILE' (stage tables or device profiles, as 'xllm "
        "plan prfaas' reads). Every replan_s the threshold is searched again over the measured uncached "
        "lengths, output lengths and link, and the best local P/D split is reported. Empty: off.",
    )
    replan_s: float = _f(60.0, "Long-term re-planning period.")

    def instance_names(self) -> list[str]:
        return [n.strip() for n in self.instances.split(",") if n.strip()]

    def profile_paths(self) -> tuple[str, str] | None:
        parts = [p.strip() for p in self.plan_profiles.split(",") if p.strip()]
        return (parts[0], parts[1]) if len(parts) == 2 else None

    def validate(self) -> None:
        if not self.enabled:
            return
        names = self.instance_names()
        if len(set(names)) != len(names) or any("/" in n or ":" in n for n in names):
            raise ValueError("cluster.prfaas.instances: names must be unique and contain no '/' or ':'")
        if self.threshold_tokens < 0:
            raise ValueError("cluster.prfaas.threshold_tokens must be >= 0")
        if not self.link_gbps > 0 or not self.tick_s > 0 or not self.replan_s > 0 or not self.max_queue_s > 0:
            raise ValueError("cluster.prfaas: link_gbps, tick_s, replan_s and max_queue_s must be > 0")
        if not 0 < self.low_utilization < self.high_utilization <= 1:
            raise ValueError("cluster.prfaas: need 0 < low_utilization < high_utilization <= 1")
        if self.plan_profiles.strip() and self.profile_paths() is None:
            raise ValueError("cluster.prfaas.plan_profiles: give 'PRFAAS_PROFILE,LOCAL_PROFILE'")
        if not self.key_prefix.rstrip("/"):
            raise ValueError("cluster.prfaas.key_prefix must not be empty (the PrfaaS cluster's namespace)")
