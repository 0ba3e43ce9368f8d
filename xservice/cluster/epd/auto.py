"""``cluster.epd.strategy: auto``: the EPD profiler at start-up, then its choice deployed (torch-free).

Before any engine starts, ``xllm serve`` profiles the model on this machine for ``cluster.epd.workload``
under ``cluster.slo.ttft_ms`` / ``tpot_ms`` over the listed instances (``run_profile``, the code
behind ``xllm profile epd``; progress on stderr), or reuses the profile cached for the same model
files, workload, SLOs, instance count, threads, effort and candidates
(``<epd.profile_cache_dir>/epd-<hash>.json``; ``cluster.epd.reprofile`` or deleting the file
forces a new one). ``plan_deployment`` (pure) turns the report into roles and engine budgets; the
service then runs exactly as with that fixed ``epd.strategy`` (or plain colocated instances for
``none``). The choice is printed and shown at ``GET /v1/admin/instances`` under ``epd_auto``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xengine.api.config import EngineConfig
from xengine.api.paths import cache_dir
from xservice.cluster.epd.profiler import ProbeError, ProfileRequest, run_profile
from xservice.cluster.epd.workload import parse_workload
from xservice.config import XllmConfig
from xservice.policies.epd import EPDSLO
from xservice.policies.epd.assign import (
    EPDDeployment,
    engine_for,
    goodput_by_strategy,
    plan_deployment,
    policy_strategies,
)

CACHE_VERSION = 1  # bump when the report's meaning changes: old cache files then miss
QUICK = {"repeats": 1, "max_batch": 4, "max_images": 4, "max_encode_images": 8, "max_prefill_tokens": 512}


class EPDAutoError(RuntimeError):
    """Profiling failed, or its choice does not make a valid deployment (a one-line message)."""


class _Cancelled(Exception):
    """The service was interrupted while profiling."""


@dataclass(frozen=True)
class EPDAuto:
    cfg: XllmConfig  # with cluster.epd.strategy and cluster.launch.instances resolved
    engines: dict[str, EngineConfig]  # per instance: the engine config with its budgets
    view: dict[str, Any]  # GET /v1/admin/instances -> epd_auto


def profile_request(cfg: XllmConfig) -> ProfileRequest:
    """What to profile: the model, workload, SLOs, instances and effort of ``cfg``."""
    cl = cfg.cluster
    effort = QUICK if cl.epd.profile_effort == "quick" else {}
    return ProfileRequest(
        model=cfg.model.model,
        slo=EPDSLO(cl.slo.ttft_ms / 1e3, cl.slo.tpot_ms / 1e3),
        num_instances=len(cl.instance_specs()),
        threads=cfg.device.num_threads,
        strategies=policy_strategies(cl.epd.auto_strategies_list()),
        **parse_workload(cl.epd.workload),
        **effort,  # type: ignore[arg-type]
    )


def cache_key(cfg: XllmConfig, req: ProfileRequest) -> dict[str, Any]:
    """Everything the profile depends on: the model's files (mtime, size), workload, SLOs, instances,
    threads, effort, candidates and device."""
    folder = Path(req.model)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    stamps = [[f.name, f.stat().st_mtime_ns, f.stat().st_size] for f in files if f.is_file()]
    fields = dataclasses.asdict(req)
    del fields["model"]
    return {
        "version": CACHE_VERSION,
        "model": req.model,
        "files": stamps,
        "device": cfg.device.device,
        **fields,
    }


def cache_file(cfg: XllmConfig, key: dict[str, Any]) -> Path:
    folder = cfg.cluster.epd.profile_cache_dir or str(cache_dir() / "epd_profiles")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(folder).expanduser() / f"epd-{digest}.json"


def resolve_epd_auto(cfg: XllmConfig, stop: threading.Event | None = None) -> EPDAuto:
    """Profile (or read the cached profile), choose, and resolve ``cfg`` to the chosen deployment.
    Blocking (run it in a thread); ``stop`` set aborts a profile in progress."""
    req = profile_request(cfg)
    key = json.loads(json.dumps(cache_key(cfg, req)))  # tuples as lists, as the file holds them
    path = cache_file(cfg, key)
    report = None if cfg.cluster.epd.reprofile else _read_cache(path, key)
    source = "cache"
    if report is None:
        source = "profile"
        report = _profile(req, stop)
        _write_cache(path, key, report)
    names = [name for name, _ in cfg.cluster.instance_specs()]
    try:
        plan = plan_deployment(report, names, cfg.scheduler.enable_chunked_prefill)
        cluster = dataclasses.replace(
            cfg.cluster,
            epd=dataclasses.replace(cfg.cluster.epd, strategy=plan.strategy),
            launch=dataclasses.replace(cfg.cluster.launch, instances=plan.instances()),
        )
        cluster.validate()
        engines = {name: engine_for(cfg.engine, plan.overrides[name]) for name in names}
        for engine in engines.values():
            engine.validate()
    except (ValueError, KeyError) as e:
        raise EPDAutoError(f"cluster.epd.strategy auto: the profile's choice cannot be deployed: {e}") from e
    view = _view(report, plan, source, path)
    print(_summary(view), file=sys.stderr, flush=True)
    return EPDAuto(dataclasses.replace(cfg, cluster=cluster), engines, view)


def _profile(req: ProfileRequest, stop: threading.Event | None) -> dict[str, Any]:
    print(
        f"xllm: EPD auto: profiling {req.model} for {req.num_instances} instance(s) "
        "(cached for the next start)",
        file=sys.stderr,
        flush=True,
    )

    def progress(what: str) -> None:
        if stop is not None and stop.is_set():
            raise _Cancelled
        print(f"xllm: EPD profiler: {what}", file=sys.stderr, flush=True)

    try:
        return run_profile(req, progress)
    except (ProbeError, ValueError) as e:
        raise EPDAutoError(f"cluster.epd.strategy auto: profiling failed: {e}") from e
    except _Cancelled:
        raise EPDAutoError("cluster.epd.strategy auto: profiling interrupted") from None


def _read_cache(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached report for ``key``; None when absent, unreadable or for another key."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        print(f"xllm: EPD auto: ignoring the unreadable cache file {path}: {e}", file=sys.stderr)
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("report"), dict):
        return None
    return data["report"]


def _write_cache(path: Path, key: dict[str, Any], report: dict[str, Any]) -> None:
    """Write atomically (a crash leaves the old file or none); a failure only costs the next start."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "report": report}, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"xllm: EPD auto: could not cache the profile in {path}: {e}", file=sys.stderr)


def _view(report: dict[str, Any], plan: EPDDeployment, source: str, path: Path) -> dict[str, Any]:
    measured, budgets = report["budgets"]["measured"], report["budgets"]
    return {
        "enabled": True,
        "strategy": plan.strategy,
        "roles": plan.roles,
        "choice": report["choice"],
        "goodput": goodput_by_strategy(report),
        "budgets": {
            "decode_batch": budgets["decode_batch"],
            "tau_e": measured["tau_e"],
            "tau_t": measured["tau_t"],
            "feasible": measured["feasible"],
        },
        "overrides": plan.overrides,
        "notes": plan.notes,
        "workload": report["workload"],
        "slo": report["slo"],
        "source": source,
        "cache_file": str(path),
    }


def _summary(view: dict[str, Any]) -> str:
    pools: dict[str, list[str]] = {}
    for name, role in view["roles"].items():
        pools.setdefault(role, []).append(name)
    goodput = ", ".join(f"{s} {g:.3g}" for s, g in view["goodput"].items())
    by_budget: dict[str, list[str]] = {}  # instances with the same overrides share one entry
    for name, over in view["overrides"].items():
        if over:
            by_budget.setdefault(" ".join(f"{k}={v}" for k, v in over.items()), []).append(name)
    applied = "; ".join(f"{', '.join(names)}: {budget}" for budget, names in by_budget.items())
    from_where = "cached profile " + view["cache_file"] if view["source"] == "cache" else "new profile"
    return (
        f"xllm: EPD auto: strategy {view['strategy']} ("
        + "; ".join(f"{role}: {', '.join(names)}" for role, names in pools.items())
        + f") from the {from_where}; predicted goodput (req/s): {goodput}; "
        + f"budgets at {view['budgets']['decode_batch']} decodes: {applied or 'none applied'}"
        + "".join(f"; {note}" for note in view["notes"])
    )
