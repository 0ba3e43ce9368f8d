"""``ClusterConfig``: the ``cluster`` section of the config file, in sub-sections (torch-free).

``cluster.launch`` says which engine instances run and how they start, ``registry`` where they
register, ``routing`` how requests pick one, ``slo`` the latency targets, ``pd`` / ``colocation`` /
``epd`` the disaggregation features, ``auth`` the internal planes' keys and ``prfaas`` the
Prefill-as-a-Service cluster. With ``launch.instances`` empty (the default) ``xllm serve`` runs the
single-node service over one engine it spawns itself; with ``launch.launcher: external`` it serves whatever registered in etcd. The
former flat keys (``cluster.pd_mode``) still load: ``xservice/cluster/legacy_keys.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xengine.api.paths import default_cluster_key_file
from xengine.api.security import ClusterKey, load_or_create_key_file
from xservice.cluster.config_sections import (
    AUTO,
    EPD_STRATEGIES,
    INSTANCE_ROLES,
    LAUNCHERS,
    PD_MODES,
    PROFILE_EFFORTS,
    STORES,
    AuthConfig,
    ColocationConfig,
    EPDConfig,
    LaunchConfig,
    PDConfig,
    RegistryConfig,
    RoutingConfig,
    SLOConfig,
)
from xservice.cluster.epd.workload import parse_workload
from xservice.cluster.prfaas.config import PrfaasConfig

__all__ = [
    "AUTO",
    "EPD_STRATEGIES",
    "INSTANCE_ROLES",
    "LAUNCHERS",
    "PD_MODES",
    "PROFILE_EFFORTS",
    "STORES",
    "AuthConfig",
    "ClusterConfig",
    "ColocationConfig",
    "EPDConfig",
    "LaunchConfig",
    "PDConfig",
    "PrfaasConfig",
    "RegistryConfig",
    "RoutingConfig",
    "SLOConfig",
]


def _section(cls: type) -> object:
    return field(default_factory=cls)


@dataclass(frozen=True)
class ClusterConfig:
    """The ``cluster`` section: one frozen sub-section per concern (``cfg.cluster.pd.mode``)."""

    launch: LaunchConfig = _section(LaunchConfig)  # type: ignore[assignment]
    registry: RegistryConfig = _section(RegistryConfig)  # type: ignore[assignment]
    routing: RoutingConfig = _section(RoutingConfig)  # type: ignore[assignment]
    slo: SLOConfig = _section(SLOConfig)  # type: ignore[assignment]
    pd: PDConfig = _section(PDConfig)  # type: ignore[assignment]
    colocation: ColocationConfig = _section(ColocationConfig)  # type: ignore[assignment]
    epd: EPDConfig = _section(EPDConfig)  # type: ignore[assignment]
    auth: AuthConfig = _section(AuthConfig)  # type: ignore[assignment]
    prfaas: PrfaasConfig = _section(PrfaasConfig)  # type: ignore[assignment]

    def cluster_key(self) -> ClusterKey | None:
        """The key that authenticates this cluster's planes (None when ``auth.enabled`` is off); reads or
        creates the key file when one applies, else makes an ephemeral key."""
        if not self.auth.enabled:
            return None
        if self.auth.key_file or self.external:
            return load_or_create_key_file(self.auth.key_file or default_cluster_key_file())
        return ClusterKey.generate()

    @property
    def enabled(self) -> bool:
        return bool(self.launch.instances.strip()) or self.external

    @property
    def external(self) -> bool:
        """Attach mode: the service launches nothing and serves the registered instances."""
        return self.launch.launcher == "external"

    def instance_specs(self) -> list[tuple[str, str]]:
        """``[(name, role)]`` parsed from ``launch.instances`` (no role: ``mixed``, or ``auto`` under
        ``epd.strategy: auto``)."""
        default = AUTO if self.epd.strategy == AUTO else "mixed"
        specs = []
        for item in (x.strip() for x in self.launch.instances.split(",")):
            if item:
                name, _, role = item.partition(":")
                specs.append((name.strip(), role.strip() or default))
        return specs

    def validate(self) -> None:
        specs = self.instance_specs()
        _validate_roles(specs)
        if self.epd.strategy == AUTO:
            self._validate_epd_auto(specs)
        elif any(role == AUTO for _, role in specs):
            raise ValueError("cluster.launch.instances: role 'auto' needs cluster.epd.strategy: auto")
        else:
            self._validate_epd(specs)
        self.launch.validate()
        self.registry.validate()
        if self.external and self.registry.store != "etcd":
            raise ValueError(
                "cluster.launch.launcher 'external' needs cluster.registry.store: etcd (the embedded store "
                "lives in the service, so engines could not outlive it); start etcd (ci/etcd.sh start) and "
                "set cluster.registry.etcd_endpoint"
            )
        self.routing.validate()
        self.pd.validate()
        if self.colocation.enabled:
            self._validate_colocation(specs)
        if self.pd.dynamic:
            self._validate_dynamic_pd(specs)
        if self.prfaas.enabled:
            self._validate_prfaas(specs)

    def _validate_epd(self, specs: list[tuple[str, str]]) -> None:
        roles = {role for _, role in specs}
        strategy = self.epd.strategy
        if strategy != "none" and strategy not in EPD_STRATEGIES:
            raise ValueError(
                f"cluster.epd.strategy must be one of none, {', '.join(EPD_STRATEGIES)}, auto (got {strategy!r})"
            )
        encode_roles = sorted(roles & {"encode", "encode_prefill", "encode_decode"})
        if strategy == "none":
            if encode_roles:
                raise ValueError(
                    f"cluster.launch.instances has {', '.join(encode_roles)} instances: set "
                    f"cluster.epd.strategy (one of {', '.join(EPD_STRATEGIES)}) to use them"
                )
            if specs and "mixed" not in roles and not {"prefill", "decode"} <= roles:
                raise ValueError(
                    "cluster.launch.instances: needs at least one 'mixed' instance, or a 'prefill' and a "
                    "'decode' one"
                )
            return
        if self.pd.mode != "static" or self.colocation.enabled:
            raise ValueError("cluster.epd.strategy needs cluster.pd.mode: static and colocation off")
        if self.external or not specs:
            return
        wanted = EPD_STRATEGIES[strategy]
        missing = [r for r in wanted if r not in roles]
        extra = sorted(roles - set(wanted) - {"mixed"})
        if missing or extra:
            raise ValueError(
                f"cluster.epd.strategy {strategy!r} runs {' + '.join(wanted)} instances: "
                + (f"cluster.launch.instances has no {', '.join(missing)} instance" if missing else "")
                + ("; " if missing and extra else "")
                + (f"roles {', '.join(extra)} do not belong to it" if extra else "")
            )

    def _validate_epd_auto(self, specs: list[tuple[str, str]]) -> None:
        """``epd.strategy: auto``: named instances to give roles to, a workload, SLOs, candidates."""
        if self.pd.mode != "static" or self.colocation.enabled:
            raise ValueError("cluster.epd.strategy 'auto' needs cluster.pd.mode: static and colocation off")
        if self.external or not specs:
            raise ValueError(
                "cluster.epd.strategy 'auto' launches the instances it gives roles to: list their names in "
                "cluster.launch.instances (e.g. 'engine-0,engine-1,engine-2') with launcher local or ray"
            )
        fixed = [f"{n}:{r}" for n, r in specs if r != AUTO]
        if fixed:
            raise ValueError(
                f"cluster.epd.strategy 'auto' chooses every instance's role: list the instances without one "
                f"(or with role 'auto'); got {', '.join(fixed)}"
            )
        if not self.epd.workload:
            raise ValueError(
                "cluster.epd.strategy 'auto' needs cluster.epd.workload: 'image-heavy', 'text-heavy' or a "
                "description (images_per_request, image_size, prompt_tokens, output_tokens)"
            )
        parse_workload(self.epd.workload)
        self.slo.check_positive()
        if self.epd.profile_effort not in PROFILE_EFFORTS:
            raise ValueError(f"cluster.epd.profile_effort must be one of {', '.join(PROFILE_EFFORTS)}")
        candidates = self.epd.auto_strategies_list()
        if not any(len(EPD_STRATEGIES.get(s, ("mixed",))) <= len(specs) for s in candidates):
            raise ValueError(
                f"cluster.epd.auto_strategies {', '.join(candidates)}: none fits {len(specs)} instance(s) "
                "(E+P+D needs 3, EP+D and ED+P 2); list more instances or add 'none'"
            )

    def _validate_dynamic_pd(self, specs: list[tuple[str, str]]) -> None:
        self.slo.check_positive()
        if self.external or not specs:
            return
        roles = [role for _, role in specs]
        if "mixed" in roles:
            raise ValueError(
                "cluster.pd.mode 'dynamic' pools prefill and decode instances: give every instance the role "
                "prefill or decode (its starting pool), not mixed"
            )
        pd = self.pd
        if (
            roles.count("prefill") < pd.min_prefill_instances
            or roles.count("decode") < pd.min_decode_instances
        ):
            raise ValueError(
                f"cluster.pd.mode 'dynamic' needs at least {pd.min_prefill_instances} prefill and "
                f"{pd.min_decode_instances} decode instance(s) at launch (cluster.pd.min_prefill_instances, "
                "cluster.pd.min_decode_instances)"
            )

    def _validate_prfaas(self, specs: list[tuple[str, str]]) -> None:
        self.prfaas.validate()
        if self.epd.strategy != "none":
            raise ValueError("cluster.prfaas needs cluster.epd.strategy: none")
        roles = {role for _, role in specs}
        if not self.external and not {"prefill", "decode"} <= roles:
            raise ValueError(
                "cluster.prfaas sends long prompts to the PrfaaS cluster and keeps short ones on the local "
                "cluster's prefill instances; its KV goes to a local decode instance: launch at least one "
                "'prefill' and one 'decode' instance (cluster.launch.instances)"
            )
        if set(self.prfaas.instance_names()) & {n for n, _ in specs}:
            raise ValueError("cluster.prfaas.instances: names must differ from cluster.launch.instances'")
        if self.prfaas.key_prefix.rstrip("/") == self.registry.key_prefix.rstrip("/"):
            raise ValueError(
                "cluster.prfaas.key_prefix must differ from cluster.registry.key_prefix (its own namespace)"
            )
        if self.prfaas.netns and not self.prfaas.engine_host:
            raise ValueError(
                "cluster.prfaas.netns: set cluster.prfaas.engine_host to the instances' address in that namespace "
                "(ci/netns.sh: 10.77.0.2), which the service and the local decode instances reach"
            )
        if self.prfaas.netns and self.registry.store == "embedded" and not self.prfaas.store_host:
            raise ValueError(
                "cluster.prfaas.netns: set cluster.prfaas.store_host to the service's address on the link "
                "(ci/netns.sh: 10.77.0.1), where the instances reach the embedded store"
            )

    def _validate_colocation(self, specs: list[tuple[str, str]]) -> None:
        if self.slo.tpot_ms <= 0:
            raise ValueError("cluster.colocation needs cluster.slo.tpot_ms > 0")
        self.colocation.validate()
        roles = {role for _, role in specs}
        if specs and not self.external and not {"prefill", "decode"} <= roles:
            raise ValueError(
                "cluster.colocation pools prefill instances (latency-relaxed) and decode instances "
                "(latency-strict): launch at least one of each"
            )


def _validate_roles(specs: list[tuple[str, str]]) -> None:
    names = [n for n, _ in specs]
    if len(set(names)) != len(names) or any(not n or "/" in n for n in names):
        raise ValueError("cluster.launch.instances: names must be unique, non-empty and contain no '/'")
    for name, role in specs:
        if role not in INSTANCE_ROLES and role != AUTO:
            raise ValueError(
                f"cluster.launch.instances: role of {name!r} must be one of {', '.join(INSTANCE_ROLES)}"
            )
