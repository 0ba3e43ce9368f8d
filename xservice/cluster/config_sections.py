"""The sub-sections of ``cluster`` (``cluster.launch``, ``registry``, ``routing``, ``slo``, ``pd``,
``colocation``, ``epd``, ``auth``): each field once, its help text the CLI help (torch-free).

Each section checks its own fields; ``ClusterConfig.validate`` (``config.py``) checks how they combine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xengine.api.config import EngineConfig, _f
from xservice.cluster.epd.workload import workload_text

STORES = ("embedded", "etcd")
PD_MODES = ("static", "dynamic")
LAUNCHERS = ("local", "ray", "external")
INSTANCE_ROLES = ("mixed", "prefill", "decode", "encode", "encode_prefill", "encode_decode")
AUTO = "auto"  # epd.strategy and instance role: chosen by the EPD profiler at start-up
PROFILE_EFFORTS = ("full", "quick")
# EPD strategy -> the roles its instances take (docs/multimodal.md, "EPD disaggregation")
EPD_STRATEGIES: dict[str, tuple[str, ...]] = {
    "E+P+D": ("encode", "prefill", "decode"),
    "EP+D": ("encode_prefill", "decode"),
    "ED+P": ("encode_decode", "prefill"),
}


@dataclass(frozen=True)
class LaunchConfig:
    """``cluster.launch``: the engine instances and how they are started."""

    instances: str = _f(
        "",
        "Engine instances to launch, comma-separated 'name:role' (role: mixed, prefill, decode; with "
        "epd.strategy also encode, encode_prefill, encode_decode), e.g. "
        "'engine-0:mixed,engine-1:mixed'. Empty: single-node mode (unless launcher is 'external'). With "
        "launcher 'external': the names to wait for before serving (roles come from their registrations). "
        "With epd.strategy 'auto': names only (or role 'auto'); the profiler gives each its role.",
    )
    launcher: str = _f(
        "local",
        "How instances are started: 'local' (subprocesses, they die with the service), 'ray' (Ray actors) "
        "or 'external' (none: serve the instances registered in etcd by 'xllm engine', which outlive the "
        "service; a restarted service rebuilds its prefix index from etcd; needs registry.store etcd).",
    )
    engine_host: str = _f("127.0.0.1", "Address instances bind their ZMQ sockets to (loopback by default).")
    engine_nice: int = _f(
        0,
        "Nice value (0-19) of engine processes: those the service launches ('local', 'ray') and 'xllm engine' "
        "with this config. On CPU hosts where the API server shares cores with busy engines, a positive "
        "value keeps the front door responsive (online TTFT beside a saturating batch job: "
        "docs/colocation.md); no privilege needed. Engines on accelerators rarely need it.",
    )
    startup_timeout_s: float = _f(600.0, "How long to wait for every instance to register.")
    prefill_tensor_parallel_size: int = _f(
        0,
        "Tensor-parallel ranks of each prefill instance the service launches (0: the engine's "
        "parallel.tensor_parallel_size). PD moves the KV between different layouts: each decode rank "
        "reads its KV heads from the prefill ranks holding them.",
    )
    decode_tensor_parallel_size: int = _f(
        0, "Tensor-parallel ranks of each decode instance the service launches (0: the engine's)."
    )

    def engine_for(self, role: str, engine: EngineConfig) -> EngineConfig:
        """The engine config of an instance launched in ``role``: its role's parallel layout."""
        tp = {"prefill": self.prefill_tensor_parallel_size, "decode": self.decode_tensor_parallel_size}
        size = tp.get(role, 0)
        if not size:
            return engine
        return dataclasses.replace(
            engine, parallel=dataclasses.replace(engine.parallel, tensor_parallel_size=size)
        )

    def validate(self) -> None:
        if self.prefill_tensor_parallel_size < 0 or self.decode_tensor_parallel_size < 0:
            raise ValueError(
                "cluster.launch.prefill_tensor_parallel_size / decode_tensor_parallel_size must be >= 0"
            )
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"cluster.launch.launcher must be one of {', '.join(LAUNCHERS)}")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"cluster.launch.engine_nice must be in 0..19, got {self.engine_nice}")


@dataclass(frozen=True)
class RegistryConfig:
    """``cluster.registry``: the metadata store instances register in, and how liveness is judged."""

    store: str = _f("embedded", "Metadata store: 'embedded' (in the service) or 'etcd'.")
    etcd_endpoint: str = _f("127.0.0.1:2379", "etcd client endpoint HOST:PORT (store: etcd).")
    key_prefix: str = _f("/xllm", "Prefix of every key xllm writes in the metadata store.")
    lease_ttl_s: float = _f(3.0, "Instance registration lease TTL; a dead instance is gone after it.")
    heartbeat_interval_s: float = _f(0.5, "How often instances renew their lease and report load/KV events.")
    migrate_on_failure: bool = _f(True, "Re-run in-flight requests of a dead instance on a healthy one.")

    def validate(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"cluster.registry.store must be one of {', '.join(STORES)}")
        if not (0 < self.heartbeat_interval_s < self.lease_ttl_s):
            raise ValueError("cluster.registry: need 0 < heartbeat_interval_s < lease_ttl_s")

    @property
    def store_url(self) -> str:
        return f"etcd://{self.etcd_endpoint}"


@dataclass(frozen=True)
class RoutingConfig:
    """``cluster.routing``: which instance a request goes to."""

    policy: str = _f("cache_aware", "Routing policy: round_robin, least_load or cache_aware.")
    cache_match_weight: float = _f(2.0, "cache_aware: weight of the prefix-match fraction against load.")

    def validate(self) -> None:
        from xservice.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"cluster.routing.policy must be one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class SLOConfig:
    """``cluster.slo``: the latency targets dynamic PD, co-location and EPD auto work to."""

    ttft_ms: float = _f(
        1000.0,
        "Time-to-first-token SLO: dynamic PD's default (a request may set its own); epd.strategy 'auto': "
        "the TTFT SLO the strategy is chosen for.",
    )
    tpot_ms: float = _f(
        100.0,
        "Time-per-output-token SLO: dynamic PD's default (a request may set its own); co-location's strict "
        "decode step budget; epd.strategy 'auto': the TPOT SLO the strategy and Algorithm 1's budgets are "
        "chosen for.",
    )

    def check_positive(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError("cluster.slo.ttft_ms and cluster.slo.tpot_ms must be > 0")


@dataclass(frozen=True)
class PDConfig:
    """``cluster.pd``: prefill/decode disaggregation, static or dynamic (docs/dynamic_pd.md)."""

    mode: str = _f(
        "static",
        "PD disaggregation: 'static' (roles fixed at launch) or 'dynamic' (xLLM §3.2: roles are service-side "
        "pools P, D, P→D, D→P kept in the metadata store; SLO-aware routing with TTFT/TPOT predictors; "
        "instances flip role with zero wait; docs/dynamic_pd.md). Dynamic needs prefill and decode instances.",
    )
    min_decode_instances: int = _f(2, "Dynamic PD: never flip below this many decode-side instances.")
    min_prefill_instances: int = _f(1, "Dynamic PD: never flip below this many prefill-side instances.")
    flip_cooldown_s: float = _f(
        5.0, "Dynamic PD: an instance does not flip again, nor the cluster the other way, within this time."
    )
    flip_min_interval_s: float = _f(
        1.0,
        "Dynamic PD: at most one flip plan (one flip, or flip_share of the instances) per this many seconds.",
    )
    prefill_idle_s: float = _f(
        3.0,
        "Dynamic PD: a prefill instance busy under 20% of this window while decode is busy flips to decode.",
    )
    tpot_miss_sustain_s: float = _f(
        1.0, "Dynamic PD: how long observed TPOT must miss its SLO before a flip."
    )
    decode_capacity_pressure: float = _f(
        0.9,
        "Dynamic PD: when the decode side's KV is committed (placed streams at prompt + max_tokens) to this "
        "share of its capacity, a spare prefill instance flips to decode.",
    )
    prefill_backlog: float = _f(
        0.3,
        "Dynamic PD: when the prefill side's predicted queueing, averaged over its instances, reaches this "
        "share of the TTFT SLO while decode copes, a decode instance flips to prefill (before the SLO is missed).",
    )
    flip_share: float = _f(
        0.05, "Dynamic PD: one flip plan may flip this share of the instances at once (at least one)."
    )
    startup_profile: bool = _f(True, "Dynamic PD: probe each instance when it joins to seed its predictors.")

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    def validate(self) -> None:
        if self.mode not in PD_MODES:
            raise ValueError(f"cluster.pd.mode must be one of {', '.join(PD_MODES)}")
        if not self.dynamic:
            return
        if self.min_decode_instances < 1 or self.min_prefill_instances < 1:
            raise ValueError(
                "cluster.pd.min_decode_instances and cluster.pd.min_prefill_instances must be >= 1"
            )
        if not 0 < self.decode_capacity_pressure <= 1:
            raise ValueError("cluster.pd.decode_capacity_pressure must be in (0, 1]")
        if self.prefill_backlog <= 0 or not 0 < self.flip_share <= 1:
            raise ValueError("cluster.pd.prefill_backlog must be > 0 and cluster.pd.flip_share in (0, 1]")


@dataclass(frozen=True)
class ColocationConfig:
    """``cluster.colocation``: online/offline co-location over prefill and decode pools (docs/colocation.md)."""

    enabled: bool = _f(
        False,
        "Online/offline co-location (xLLM §3.1, docs/colocation.md): prefill instances are the latency-relaxed "
        "pool (every prefill; offline decodes), decode instances the latency-strict pool (online decodes, plus "
        "offline ones while the roofline model predicts slo.tpot_ms holds). Needs prefill and decode instances.",
    )
    headroom: float = _f(
        0.8,
        "Co-location: offline decodes join a strict batch only while its predicted step <= this x slo.tpot_ms.",
    )
    peak_gflops_per_thread: float = _f(80.0, "Co-location roofline: matmul GFLOP/s per engine thread (CPU).")
    mem_bw_gbps: float = _f(15.0, "Co-location roofline: memory bandwidth of an instance in GB/s.")

    def validate(self) -> None:
        if not 0 < self.headroom <= 1:
            raise ValueError("cluster.colocation.headroom must be in (0, 1]")
        if self.peak_gflops_per_thread <= 0 or self.mem_bw_gbps <= 0:
            raise ValueError(
                "cluster.colocation.peak_gflops_per_thread and cluster.colocation.mem_bw_gbps must be > 0"
            )


@dataclass(frozen=True)
class EPDConfig:
    """``cluster.epd``: encode/prefill/decode disaggregation of image requests (docs/multimodal.md)."""

    strategy: str = _f(
        "none",
        "EPD disaggregation of image requests (docs/multimodal.md): 'none', 'E+P+D' (encode, prefill and "
        "decode instances), 'EP+D' (encode_prefill + decode) or 'ED+P' (encode_decode + prefill). Image "
        "embeddings move E->P and KV P->D over Mooncake; text requests run plain PD. 'auto': at start-up the "
        "EPD profiler measures the model here and picks the strategy, the roles and Algorithm 1's budgets "
        "for epd.workload under slo.ttft_ms / slo.tpot_ms (cached; docs/multimodal.md, 'EPD auto').",
    )
    workload: str = _f(
        "",
        "strategy 'auto': the workload to choose for: 'image-heavy' or 'text-heavy' (xllm profile epd's "
        "named workloads), or a description: in YAML a mapping of images_per_request, image_size (WxH), "
        "prompt_tokens, output_tokens and optionally request_rate (requests/s, or 'max'); as a flag "
        "'images_per_request=2,image_size=448x448,prompt_tokens=128,output_tokens=64'.",
    )
    auto_strategies: str = _f(
        "",
        "strategy 'auto': the strategies it may choose, comma-separated from E+P+D, EP+D, ED+P and none "
        "(colocated: every instance mixed); empty: all of them.",
    )
    profile_effort: str = _f(
        "full",
        "strategy 'auto': 'full' (xllm profile epd's defaults) or 'quick' (1 repeat, batches up to 4 "
        "decodes / 4 images, budgets searched up to 8 images / 512 tokens).",
    )
    profile_cache_dir: str = _f(
        "",
        "strategy 'auto': folder of cached profiles, one file per model (path, config and weight "
        "mtimes), workload, SLOs, instance count, threads and effort; default $XLLM_CACHE_DIR/epd_profiles. "
        "Deleting a file forces a new profile.",
    )
    reprofile: bool = _f(
        False, "strategy 'auto': profile again at start-up even when a cached profile matches."
    )

    def __post_init__(self) -> None:
        if isinstance(self.workload, dict):  # YAML's mapping form, kept as its one-line flag form
            object.__setattr__(self, "workload", workload_text(self.workload))

    def auto_strategies_list(self) -> tuple[str, ...]:
        """The strategies ``strategy: auto`` may choose (cluster names: ``none`` is colocated)."""
        known = ("none", *EPD_STRATEGIES)
        names = tuple(s.strip() for s in self.auto_strategies.split(",") if s.strip()) or known
        bad = [s for s in names if s not in known]
        if bad or len(set(names)) != len(names):
            raise ValueError(
                f"cluster.epd.auto_strategies must list distinct strategies from {', '.join(known)} "
                f"(got {self.auto_strategies!r})"
            )
        return names


@dataclass(frozen=True)
class AuthConfig:
    """``cluster.auth``: authentication of the internal planes (docs/security.md)."""

    enabled: bool = _f(
        True,
        "Authenticate the internal planes (engine ZMQ sockets, embedded-store bridge) with ZMQ CURVE and a "
        "per-cluster key (docs/security.md); turn off only on an isolated network.",
    )
    key_file: str = _f(
        "",
        "Cluster key file (mode 0600). Empty: launched instances get an ephemeral key from the service; with "
        "launcher 'external' and for 'xllm engine' it is $XLLM_CACHE_DIR/cluster.key (~/.cache/xllm/cluster.key), "
        "created on first use.",
    )
