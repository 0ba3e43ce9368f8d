"""``ClusterConfig``: the ``cluster`` section of the config file (torch-free).

With ``instances`` empty (the default) ``xllm serve`` runs the single-node service over one
engine it spawns itself; otherwise it serves the listed instances through the instance pool.
With ``launcher: external`` it launches nothing and serves whatever instances registered in etcd
(standalone ``xllm engine`` processes that outlive the service).
"""

from __future__ import annotations

from dataclasses import dataclass

from xengine.api.config import _f
from xengine.api.paths import default_cluster_key_file
from xengine.api.security import ClusterKey, load_or_create_key_file
from xservice.cluster.epd.workload import parse_workload, workload_text

STORES = ("embedded", "etcd")
PD_MODES = ("static", "dynamic")
LAUNCHERS = ("local", "ray", "external")
INSTANCE_ROLES = ("mixed", "prefill", "decode", "encode", "encode_prefill", "encode_decode")
AUTO = "auto"  # epd_strategy and instance role: chosen by the EPD profiler at start-up
PROFILE_EFFORTS = ("full", "quick")
# EPD strategy -> the roles its instances take (docs/multimodal.md, "EPD disaggregation")
EPD_STRATEGIES: dict[str, tuple[str, ...]] = {
    "E+P+D": ("encode", "prefill", "decode"),
    "EP+D": ("encode_prefill", "decode"),
    "ED+P": ("encode_decode", "prefill"),
}


@dataclass(frozen=True)
class ClusterConfig:
    instances: str = _f(
        "",
        "Engine instances to launch, comma-separated 'name:role' (role: mixed, prefill, decode; with "
        "epd_strategy also encode, encode_prefill, encode_decode), e.g. "
        "'engine-0:mixed,engine-1:mixed'. Empty: single-node mode (unless launcher is 'external'). With "
        "launcher 'external': the names to wait for before serving (roles come from their registrations). "
        "With epd_strategy 'auto': names only (or role 'auto'); the profiler gives each its role.",
    )
    launcher: str = _f(
        "local",
        "How instances are started: 'local' (subprocesses, they die with the service), 'ray' (Ray actors) "
        "or 'external' (none: serve the instances registered in etcd by 'xllm engine', which outlive the "
        "service; a restarted service rebuilds its prefix index from etcd; needs metadata_store etcd).",
    )
    metadata_store: str = _f("embedded", "Metadata store: 'embedded' (in the service) or 'etcd'.")
    etcd_endpoint: str = _f("127.0.0.1:2379", "etcd client endpoint HOST:PORT (metadata_store: etcd).")
    key_prefix: str = _f("/xllm", "Prefix of every key xllm writes in the metadata store.")
    routing_policy: str = _f("cache_aware", "Routing policy: round_robin, least_load or cache_aware.")
    cache_match_weight: float = _f(2.0, "cache_aware: weight of the prefix-match fraction against load.")
    lease_ttl_s: float = _f(3.0, "Instance registration lease TTL; a dead instance is gone after it.")
    heartbeat_interval_s: float = _f(0.5, "How often instances renew their lease and report load/KV events.")
    engine_nice: int = _f(
        0,
        "Nice value (0-19) of engine processes: those the service launches ('local', 'ray') and 'xllm engine' "
        "with this config. On CPU hosts where the API server shares cores with busy engines, a positive "
        "value keeps the front door responsive (online TTFT beside a saturating batch job: "
        "docs/colocation.md); no privilege needed. Engines on accelerators rarely need it.",
    )
    migrate_on_failure: bool = _f(True, "Re-run in-flight requests of a dead instance on a healthy one.")
    pd_mode: str = _f(
        "static",
        "PD disaggregation: 'static' (roles fixed at launch) or 'dynamic' (xLLM §3.2: roles are service-side "
        "pools P, D, P→D, D→P kept in the metadata store; SLO-aware routing with TTFT/TPOT predictors; "
        "instances flip role with zero wait; docs/dynamic_pd.md). Dynamic needs prefill and decode instances.",
    )
    ttft_slo_ms: float = _f(
        1000.0,
        "Dynamic PD: default time-to-first-token SLO (a request may set its own); epd_strategy 'auto': the "
        "TTFT SLO the strategy is chosen for.",
    )
    tpot_slo_ms: float = _f(
        100.0,
        "Dynamic PD: default time-per-output-token SLO (a request may set its own); epd_strategy 'auto': the "
        "TPOT SLO the strategy and Algorithm 1's budgets are chosen for.",
    )
    min_decode_instances: int = _f(2, "Dynamic PD: never flip below this many decode-side instances.")
    min_prefill_instances: int = _f(1, "Dynamic PD: never flip below this many prefill-side instances.")
    flip_cooldown_s: float = _f(
        5.0, "Dynamic PD: an instance does not flip again, nor the cluster the other way, within this time."
    )
    flip_min_interval_s: float = _f(1.0, "Dynamic PD: at most one flip per this many seconds cluster-wide.")
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
    startup_profile: bool = _f(True, "Dynamic PD: probe each instance when it joins to seed its predictors.")
    colocation: bool = _f(
        False,
        "Online/offline co-location (xLLM §3.1, docs/colocation.md): prefill instances are the latency-relaxed "
        "pool (every prefill; offline decodes), decode instances the latency-strict pool (online decodes, plus "
        "offline ones while the roofline model predicts tpot_slo_ms holds). Needs prefill and decode instances.",
    )
    colocation_headroom: float = _f(
        0.8,
        "Co-location: offline decodes join a strict batch only while its predicted step <= this x tpot_slo_ms.",
    )
    peak_gflops_per_thread: float = _f(80.0, "Co-location roofline: matmul GFLOP/s per engine thread (CPU).")
    mem_bw_gbps: float = _f(15.0, "Co-location roofline: memory bandwidth of an instance in GB/s.")
    epd_strategy: str = _f(
        "none",
        "EPD disaggregation of image requests (docs/multimodal.md): 'none', 'E+P+D' (encode, prefill and "
        "decode instances), 'EP+D' (encode_prefill + decode) or 'ED+P' (encode_decode + prefill). Image "
        "embeddings move E->P and KV P->D over Mooncake; text requests run plain PD. 'auto': at start-up the "
        "EPD profiler measures the model here and picks the strategy, the roles and Algorithm 1's budgets "
        "for epd_workload under ttft_slo_ms / tpot_slo_ms (cached; docs/multimodal.md, 'EPD auto').",
    )
    epd_workload: str = _f(
        "",
        "epd_strategy 'auto': the workload to choose for: 'image-heavy' or 'text-heavy' (xllm profile epd's "
        "named workloads), or a description: in YAML a mapping of images_per_request, image_size (WxH), "
        "prompt_tokens, output_tokens and optionally request_rate (requests/s, or 'max'); as a flag "
        "'images_per_request=2,image_size=448x448,prompt_tokens=128,output_tokens=64'.",
    )
    epd_auto_strategies: str = _f(
        "",
        "epd_strategy 'auto': the strategies it may choose, comma-separated from E+P+D, EP+D, ED+P and none "
        "(colocated: every instance mixed); empty: all of them.",
    )
    epd_profile_effort: str = _f(
        "full",
        "epd_strategy 'auto': 'full' (xllm profile epd's defaults) or 'quick' (1 repeat, batches up to 4 "
        "decodes / 4 images, budgets searched up to 8 images / 512 tokens).",
    )
    epd_profile_cache_dir: str = _f(
        "",
        "epd_strategy 'auto': folder of cached profiles, one file per model (path, config and weight "
        "mtimes), workload, SLOs, instance count, threads and effort; default $XLLM_CACHE_DIR/epd_profiles. "
        "Deleting a file forces a new profile.",
    )
    epd_reprofile: bool = _f(
        False, "epd_strategy 'auto': profile again at start-up even when a cached profile matches."
    )
    engine_host: str = _f("127.0.0.1", "Address instances bind their ZMQ sockets to (loopback by default).")
    instance_startup_timeout_s: float = _f(600.0, "How long to wait for every instance to register.")
    auth: bool = _f(
        True,
        "Authenticate the internal planes (engine ZMQ sockets, embedded-store bridge) with ZMQ CURVE and a "
        "per-cluster key (docs/security.md); turn off only on an isolated network.",
    )
    auth_key_file: str = _f(
        "",
        "Cluster key file (mode 0600). Empty: launched instances get an ephemeral key from the service; with "
        "launcher 'external' and for 'xllm engine' it is $XLLM_CACHE_DIR/cluster.key (~/.cache/xllm/cluster.key), "
        "created on first use.",
    )

    def __post_init__(self) -> None:
        if isinstance(self.epd_workload, dict):  # YAML's mapping form, kept as its one-line flag form
            object.__setattr__(self, "epd_workload", workload_text(self.epd_workload))

    def cluster_key(self) -> ClusterKey | None:
        """The key that authenticates this cluster's planes (None when ``auth`` is off); reads or creates the
        key file when one applies, else makes an ephemeral key."""
        if not self.auth:
            return None
        if self.auth_key_file or self.external:
            return load_or_create_key_file(self.auth_key_file or default_cluster_key_file())
        return ClusterKey.generate()

    @property
    def enabled(self) -> bool:
        return bool(self.instances.strip()) or self.external

    @property
    def external(self) -> bool:
        """Attach mode: the service launches nothing and serves the registered instances."""
        return self.launcher == "external"

    def instance_specs(self) -> list[tuple[str, str]]:
        """``[(name, role)]`` parsed from ``instances`` (no role: ``mixed``, or ``auto`` under
        ``epd_strategy: auto``)."""
        default = AUTO if self.epd_strategy == AUTO else "mixed"
        specs = []
        for item in (x.strip() for x in self.instances.split(",")):
            if item:
                name, _, role = item.partition(":")
                specs.append((name.strip(), role.strip() or default))
        return specs

    def validate(self) -> None:
        specs = self.instance_specs()
        names = [n for n, _ in specs]
        if len(set(names)) != len(names) or any(not n or "/" in n for n in names):
            raise ValueError("cluster.instances: names must be unique, non-empty and contain no '/'")
        for name, role in specs:
            if role not in INSTANCE_ROLES and role != AUTO:
                raise ValueError(
                    f"cluster.instances: role of {name!r} must be one of {', '.join(INSTANCE_ROLES)}"
                )
        if self.epd_strategy == AUTO:
            self._validate_epd_auto(specs)
        elif any(role == AUTO for _, role in specs):
            raise ValueError("cluster.instances: role 'auto' needs cluster.epd_strategy: auto")
        else:
            self._validate_epd(specs)
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"cluster.launcher must be one of {', '.join(LAUNCHERS)}")
        if self.metadata_store not in STORES:
            raise ValueError(f"cluster.metadata_store must be one of {', '.join(STORES)}")
        if self.external and self.metadata_store != "etcd":
            raise ValueError(
                "cluster.launcher 'external' needs cluster.metadata_store: etcd (the embedded store lives "
                "in the service, so engines could not outlive it); start etcd (ci/etcd.sh start) and set "
                "cluster.etcd_endpoint"
            )
        from xservice.policies import POLICIES

        if self.routing_policy not in POLICIES:
            raise ValueError(f"cluster.routing_policy must be one of {', '.join(POLICIES)}")
        self._validate_pd_mode(specs)
        if not (0 < self.heartbeat_interval_s < self.lease_ttl_s):
            raise ValueError("cluster: need 0 < heartbeat_interval_s < lease_ttl_s")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"cluster.engine_nice must be in 0..19, got {self.engine_nice}")

    def _validate_epd(self, specs: list[tuple[str, str]]) -> None:
        roles = {role for _, role in specs}
        if self.epd_strategy != "none" and self.epd_strategy not in EPD_STRATEGIES:
            raise ValueError(
                f"cluster.epd_strategy must be one of none, {', '.join(EPD_STRATEGIES)}, auto "
                f"(got {self.epd_strategy!r})"
            )
        encode_roles = sorted(roles & {"encode", "encode_prefill", "encode_decode"})
        if self.epd_strategy == "none":
            if encode_roles:
                raise ValueError(
                    f"cluster.instances has {', '.join(encode_roles)} instances: set cluster.epd_strategy "
                    f"(one of {', '.join(EPD_STRATEGIES)}) to use them"
                )
            if specs and "mixed" not in roles and not {"prefill", "decode"} <= roles:
                raise ValueError(
                    "cluster.instances: needs at least one 'mixed' instance, or a 'prefill' and a 'decode' one"
                )
            return
        if self.pd_mode != "static" or self.colocation:
            raise ValueError("cluster.epd_strategy needs cluster.pd_mode: static and colocation off")
        if self.external or not specs:
            return
        wanted = EPD_STRATEGIES[self.epd_strategy]
        missing = [r for r in wanted if r not in roles]
        extra = sorted(roles - set(wanted) - {"mixed"})
        if missing or extra:
            raise ValueError(
                f"cluster.epd_strategy {self.epd_strategy!r} runs {' + '.join(wanted)} instances: "
                + (f"cluster.instances has no {', '.join(missing)} instance" if missing else "")
                + ("; " if missing and extra else "")
                + (f"roles {', '.join(extra)} do not belong to it" if extra else "")
            )

    def _validate_epd_auto(self, specs: list[tuple[str, str]]) -> None:
        """``epd_strategy: auto``: named instances to give roles to, a workload, SLOs, candidates."""
        if self.pd_mode != "static" or self.colocation:
            raise ValueError("cluster.epd_strategy 'auto' needs cluster.pd_mode: static and colocation off")
        if self.external or not specs:
            raise ValueError(
                "cluster.epd_strategy 'auto' launches the instances it gives roles to: list their names in "
                "cluster.instances (e.g. 'engine-0,engine-1,engine-2') with launcher local or ray"
            )
        fixed = [f"{n}:{r}" for n, r in specs if r != AUTO]
        if fixed:
            raise ValueError(
                f"cluster.epd_strategy 'auto' chooses every instance's role: list the instances without one "
                f"(or with role 'auto'); got {', '.join(fixed)}"
            )
        if not self.epd_workload:
            raise ValueError(
                "cluster.epd_strategy 'auto' needs cluster.epd_workload: 'image-heavy', 'text-heavy' or a "
                "description (images_per_request, image_size, prompt_tokens, output_tokens)"
            )
        parse_workload(self.epd_workload)
        if self.ttft_slo_ms <= 0 or self.tpot_slo_ms <= 0:
            raise ValueError("cluster.ttft_slo_ms and cluster.tpot_slo_ms must be > 0")
        if self.epd_profile_effort not in PROFILE_EFFORTS:
            raise ValueError(f"cluster.epd_profile_effort must be one of {', '.join(PROFILE_EFFORTS)}")
        candidates = self.auto_strategies()
        if not any(len(EPD_STRATEGIES.get(s, ("mixed",))) <= len(specs) for s in candidates):
            raise ValueError(
                f"cluster.epd_auto_strategies {', '.join(candidates)}: none fits {len(specs)} instance(s) "
                "(E+P+D needs 3, EP+D and ED+P 2); list more instances or add 'none'"
            )

    def auto_strategies(self) -> tuple[str, ...]:
        """The strategies ``epd_strategy: auto`` may choose (cluster names: ``none`` is colocated)."""
        known = ("none", *EPD_STRATEGIES)
        names = tuple(s.strip() for s in self.epd_auto_strategies.split(",") if s.strip()) or known
        bad = [s for s in names if s not in known]
        if bad or len(set(names)) != len(names):
            raise ValueError(
                f"cluster.epd_auto_strategies must list distinct strategies from {', '.join(known)} "
                f"(got {self.epd_auto_strategies!r})"
            )
        return names

    def _validate_pd_mode(self, specs: list[tuple[str, str]]) -> None:
        if self.pd_mode not in PD_MODES:
            raise ValueError(f"cluster.pd_mode must be one of {', '.join(PD_MODES)}")
        if self.colocation:
            self._validate_colocation(specs)
        if self.pd_mode != "dynamic":
            return
        if self.ttft_slo_ms <= 0 or self.tpot_slo_ms <= 0:
            raise ValueError("cluster.ttft_slo_ms and cluster.tpot_slo_ms must be > 0")
        if self.min_decode_instances < 1 or self.min_prefill_instances < 1:
            raise ValueError("cluster.min_decode_instances and cluster.min_prefill_instances must be >= 1")
        if not 0 < self.decode_capacity_pressure <= 1:
            raise ValueError("cluster.decode_capacity_pressure must be in (0, 1]")
        if self.external or not specs:
            return
        roles = [role for _, role in specs]
        if "mixed" in roles:
            raise ValueError(
                "cluster.pd_mode 'dynamic' pools prefill and decode instances: give every instance the role "
                "prefill or decode (its starting pool), not mixed"
            )
        if (
            roles.count("prefill") < self.min_prefill_instances
            or roles.count("decode") < self.min_decode_instances
        ):
            raise ValueError(
                f"cluster.pd_mode 'dynamic' needs at least {self.min_prefill_instances} prefill and "
                f"{self.min_decode_instances} decode instance(s) at launch (cluster.min_prefill_instances, "
                "cluster.min_decode_instances)"
            )

    def _validate_colocation(self, specs: list[tuple[str, str]]) -> None:
        if self.tpot_slo_ms <= 0 or not 0 < self.colocation_headroom <= 1:
            raise ValueError("cluster.colocation needs tpot_slo_ms > 0 and colocation_headroom in (0, 1]")
        if self.peak_gflops_per_thread <= 0 or self.mem_bw_gbps <= 0:
            raise ValueError("cluster.peak_gflops_per_thread and cluster.mem_bw_gbps must be > 0")
        roles = {role for _, role in specs}
        if specs and not self.external and not {"prefill", "decode"} <= roles:
            raise ValueError(
                "cluster.colocation pools prefill instances (latency-relaxed) and decode instances "
                "(latency-strict): launch at least one of each"
            )

    @property
    def store_url(self) -> str:
        return f"etcd://{self.etcd_endpoint}"
