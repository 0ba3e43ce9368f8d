"""The ``cluster`` mapping read from YAML or overrides, nested or in the former flat keys (torch-free).

``cluster`` used to be one flat list of keys (``pd_mode``, ``epd_strategy``, ``auth_key_file``...).
Those keys still load: each maps onto its place in a section (``cluster.pd.mode``) with a
``FutureWarning`` naming the new key, shown once per key, so existing config files keep working. A
key that is neither a section nor a former flat key is an error naming the valid keys.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from typing import Any

from xengine.api.config import from_dict
from xservice.cluster.config import ClusterConfig

# former flat key -> (section, field)
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "instances": ("launch", "instances"),
    "launcher": ("launch", "launcher"),
    "engine_host": ("launch", "engine_host"),
    "engine_nice": ("launch", "engine_nice"),
    "instance_startup_timeout_s": ("launch", "startup_timeout_s"),
    "metadata_store": ("registry", "store"),
    "etcd_endpoint": ("registry", "etcd_endpoint"),
    "key_prefix": ("registry", "key_prefix"),
    "lease_ttl_s": ("registry", "lease_ttl_s"),
    "heartbeat_interval_s": ("registry", "heartbeat_interval_s"),
    "migrate_on_failure": ("registry", "migrate_on_failure"),
    "routing_policy": ("routing", "policy"),
    "cache_match_weight": ("routing", "cache_match_weight"),
    "ttft_slo_ms": ("slo", "ttft_ms"),
    "tpot_slo_ms": ("slo", "tpot_ms"),
    "pd_mode": ("pd", "mode"),
    "min_decode_instances": ("pd", "min_decode_instances"),
    "min_prefill_instances": ("pd", "min_prefill_instances"),
    "flip_cooldown_s": ("pd", "flip_cooldown_s"),
    "flip_min_interval_s": ("pd", "flip_min_interval_s"),
    "prefill_idle_s": ("pd", "prefill_idle_s"),
    "tpot_miss_sustain_s": ("pd", "tpot_miss_sustain_s"),
    "decode_capacity_pressure": ("pd", "decode_capacity_pressure"),
    "prefill_backlog": ("pd", "prefill_backlog"),
    "flip_share": ("pd", "flip_share"),
    "startup_profile": ("pd", "startup_profile"),
    "colocation_headroom": ("colocation", "headroom"),
    "peak_gflops_per_thread": ("colocation", "peak_gflops_per_thread"),
    "mem_bw_gbps": ("colocation", "mem_bw_gbps"),
    "epd_strategy": ("epd", "strategy"),
    "epd_workload": ("epd", "workload"),
    "epd_auto_strategies": ("epd", "auto_strategies"),
    "epd_profile_effort": ("epd", "profile_effort"),
    "epd_profile_cache_dir": ("epd", "profile_cache_dir"),
    "epd_reprofile": ("epd", "reprofile"),
    "auth_key_file": ("auth", "key_file"),
}
# former flat booleans whose name is now a section: ``colocation: true`` is ``colocation.enabled``
FLAT_SWITCHES = {"colocation": "colocation", "auth": "auth"}


def section_types() -> dict[str, type]:
    """``{section name: its dataclass}`` of ``ClusterConfig``."""
    hints = typing.get_type_hints(ClusterConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(ClusterConfig)}


def nest(data: dict[str, Any], where: str = "cluster") -> dict[str, dict[str, Any]]:
    """``data`` as ``{section: {field: value}}``: former flat keys moved to their section (with a warning),
    unknown keys refused naming the valid ones."""
    if not isinstance(data, dict):
        raise ValueError(f"config section '{where}' must be a mapping")
    sections = section_types()
    out: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key in FLAT_SWITCHES and not isinstance(value, dict):
            section, name = FLAT_SWITCHES[key], "enabled"
        elif key in sections:
            if not isinstance(value, dict):
                raise ValueError(f"config section '{where}.{key}' must be a mapping")
            for name, sub in value.items():
                _put(out, where, key, name, sub, f"{where}.{key}.{name}")
            continue
        elif key in FLAT_KEYS:
            section, name = FLAT_KEYS[key]
        else:
            raise ValueError(f"unknown config key '{where}.{key}'; valid keys: {valid_keys(where)}")
        _warn_moved(f"{where}.{key}", f"{where}.{section}.{name}")
        _put(out, where, section, name, value, f"{where}.{key}")
    return out


def _put(out: dict[str, dict[str, Any]], where: str, section: str, name: str, value: Any, given: str) -> None:
    target = out.setdefault(section, {})
    if name in target:
        raise ValueError(f"config key '{where}.{section}.{name}' given twice (once as '{given}')")
    target[name] = value


def _warn_moved(old: str, new: str) -> None:
    # FutureWarning: shown to users by default; Python's registry shows each key's warning once
    warnings.warn(f"{old} is now {new}; the flat key still loads", FutureWarning, stacklevel=2)


def valid_keys(where: str = "cluster") -> str:
    """The sections of ``cluster`` with their fields, for error messages."""
    parts = []
    for name, cls in section_types().items():
        parts.append(f"{name} ({', '.join(f.name for f in dataclasses.fields(cls))})")
    return f"{', '.join(parts)} (as {where}.<section>.<field>)"


def cluster_from_dict(data: dict[str, Any] | None, where: str = "cluster") -> ClusterConfig:
    """A ``ClusterConfig`` from a YAML mapping, nested (``pd: {mode: dynamic}``) or flat (``pd_mode``)."""
    sections = section_types()
    nested = nest(data or {}, where)
    return ClusterConfig(
        **{name: from_dict(sections[name], values, f"{where}.{name}") for name, values in nested.items()}
    )


def replace_cluster(cluster: ClusterConfig, changes: dict[str, Any]) -> ClusterConfig:
    """``cluster`` with ``changes`` applied (nested or flat keys; a None value means "not given")."""
    nested = nest(_drop_unset(changes))
    sections = section_types()
    out = {}
    for name, values in nested.items():
        known = {f.name for f in dataclasses.fields(sections[name])}
        bad = sorted(set(values) - known)
        if bad:
            raise ValueError(
                f"unknown config key 'cluster.{name}.{bad[0]}'; valid keys: {', '.join(sorted(known))}"
            )
        out[name] = dataclasses.replace(getattr(cluster, name), **values)
    return dataclasses.replace(cluster, **out)


def _drop_unset(changes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in changes.items():
        if isinstance(value, dict) and key not in ("epd_workload",):
            value = {k: v for k, v in value.items() if v is not None}
            if value:
                out[key] = value
        elif value is not None:
            out[key] = value
    return out
