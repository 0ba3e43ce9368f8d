"""``xllm cluster status``: a running service's instances, pools, roles, flips and predictors (and the
PrfaaS cluster's threshold and link).

It reads ``GET /v1/admin/instances`` and prints it as tables (``--json``: the raw document).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

from xservice.commands.common import CliError


def register_cluster(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "cluster",
        help="inspect a running cluster service",
        description="Inspect a running xllm service: 'xllm cluster status'.",
    )
    sub = p.add_subparsers(title="cluster commands", metavar="COMMAND")
    status = sub.add_parser(
        "status",
        help="instances, pools, roles, flips and predictors",
        description="Print the instances of a running xllm service with their pool, role, health, load and "
        "(dynamic PD) predictor state, then the recent role flips with their reasons.",
    )
    status.add_argument("--url", default="http://127.0.0.1:8000", help="service URL (default: %(default)s)")
    status.add_argument("--api-key", default=None, help="API key, if the server requires one")
    status.add_argument("--json", action="store_true", help="print the raw JSON document")
    status.set_defaults(run=run_status)


def fetch_status(url: str, api_key: str | None = None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/").removesuffix("/v1")
    try:
        resp = httpx.get(f"{base}/v1/admin/instances", headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach {url} ({e}); start a service with 'xllm serve' or pass --url") from e
    if resp.status_code in (401, 403):
        raise CliError(f"{url} refused the request ({resp.status_code}); pass --api-key")
    if resp.status_code != 200:
        raise CliError(f"{url} answered {resp.status_code}: {resp.text[:200]}")
    return resp.json()


def run_status(args: argparse.Namespace) -> int:
    doc = fetch_status(args.url, args.api_key)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    import sys

    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=200)  # a pipe: do not squeeze columns
    for table in render_status(doc):
        console.print(table)
    return 0


def render_status(doc: dict[str, Any]) -> list[Any]:
    """The status document as rich renderables (a summary line, the instances, the flips)."""
    from rich.table import Table

    dyn = doc.get("dynamic_pd") or {}
    out: list[Any] = []
    summary = f"mode: {doc.get('mode', '?')}"
    if doc.get("mode") == "cluster":
        summary += f"  routing: {doc.get('routing_policy')}  store: {'ok' if doc.get('store_ok') else 'DOWN'}"
        summary += f"  migrations: {doc.get('num_migrations', 0)}"
    if dyn.get("enabled"):
        slo = dyn["slo"]
        pools = "  ".join(f"{p}: {','.join(n) or '-'}" for p, n in dyn["pools"].items())
        summary += f"\ndynamic PD  SLO ttft {slo['ttft_ms']:.0f}ms tpot {slo['tpot_ms']:.0f}ms  {pools}"
        summary += f"  flips: {dyn['num_flips']}"
    col = doc.get("colocation") or {}
    if col.get("enabled"):
        pools = col["pools"]
        summary += (
            f"\nco-location  relaxed: {','.join(pools['latency_relaxed']) or '-'}"
            f"  strict: {','.join(pools['latency_strict']) or '-'}  tpot SLO {col['tpot_slo_ms']:.0f}ms"
            f"  offline prefills {col['offline_prefills']}  decodes strict {col['offline_decodes_strict']}"
            f" / relaxed {col['offline_decodes_relaxed']}"
        )
    prf = doc.get("prfaas") or {}
    if prf.get("enabled"):
        link, req = prf["link"], prf["requests"]
        summary += (
            f"\nPrfaaS  threshold {prf['threshold_tokens']} tokens (planned {prf['planned_threshold_tokens']})"
            f"  link {link['egress_gbps']:.3g} of {link['capacity_gbps']:.3g} Gbit/s ({link['utilization']:.0%})"
            f"  backlog {link['queue_s']:.1f}s  prefills prfaas {req['prfaas']} / local {req['local']}"
            f"  threshold raises {req['threshold_raises']} lowers {req['threshold_lowers']}"
        )
        if prf.get("plan"):
            split = prf["plan"]["recommended_split"]
            summary += f"  plan: {split['prefill']}P/{split['decode']}D at {split['lambda_max_req_s']} req/s"
    out.append(summary)
    table = Table(title="instances")
    cols = ["name", "pool", "role", "healthy", "running", "waiting", "kv", "inflight", "routed"]
    if dyn.get("enabled"):
        cols += ["queue", "decoding", "tpot obs", "ttft err", "tpot err", "flips"]
    for c in cols:
        table.add_column(c)
    for inst in doc.get("instances", []):
        load = inst.get("load") or {}
        row = [
            inst["name"],
            inst.get("pool") or "-",
            inst.get("role", "-"),
            "yes" if inst.get("healthy") else "NO",
            str(load.get("num_running", "-")),
            str(load.get("num_waiting", "-")),
            f"{load['kv_usage']:.0%}" if "kv_usage" in load else "-",
            str(inst.get("num_inflight", "-")),
            str(inst.get("num_routed", "-")),
        ]
        if dyn.get("enabled"):
            pred = inst.get("predictors") or {}
            row += [
                _ms(pred.get("queue_s")),
                str(pred.get("num_decoding", "-")),
                _ms(pred.get("observed_tpot_s")),
                _pct((pred.get("ttft") or {}).get("error")),
                _pct((pred.get("tpot") or {}).get("error")),
                str(inst.get("num_flips", 0)),
            ]
        table.add_row(*row)
    out.append(table)
    if dyn.get("flips"):
        flips = Table(title="role flips")
        for c in ("time", "instance", "to", "reason"):
            flips.add_column(c)
        for f in dyn["flips"][-20:]:
            at = datetime.fromtimestamp(f["at"]).strftime("%H:%M:%S")
            flips.add_row(at, f["instance"], f["to_role"], f["reason"])
        out.append(flips)
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
