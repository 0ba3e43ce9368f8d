"""``xllm plan prfaas``: the PrfaaS-PD throughput model's grid search (``xservice/policies/prfaas``) from
profiles -- the routing threshold and the local prefill/decode split with the highest sustainable request
rate, beside homogeneous PD and naive heterogeneous PD on the same hardware -- as JSON.

Profiles are stage tables (published rows) or device profiles (``xllm profile engine``); see
``xservice/policies/prfaas/profiles.py``. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from xservice.commands.common import EXIT_USAGE, CliError


def register_plan(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="capacity planners (prfaas)", description="Capacity planners.")
    tools = p.add_subparsers(title="plan commands", metavar="COMMAND")
    f = tools.add_parser(
        "prfaas",
        help="threshold and P/D split for Prefill-as-a-Service, from profiles",
        description="Search the routing threshold t and the local prefill/decode split that maximise the "
        "sustainable request rate of a PrfaaS-PD deployment (equations 3-6 of the PrfaaS paper), and "
        "compare it with homogeneous PD and naive heterogeneous PD. Prints JSON.",
    )
    f.add_argument("--prfaas-profile", required=True, metavar="JSON", help="the PrfaaS instances' profile")
    f.add_argument("--local-profile", required=True, metavar="JSON", help="the local PD instances' profile")
    f.add_argument("--prfaas-speedup", type=float, default=1.0, help="divide the PrfaaS profile's latencies")
    f.add_argument("--prfaas-instances", type=int, required=True, metavar="N")
    f.add_argument("--local-instances", type=int, required=True, metavar="M")
    f.add_argument(
        "--homogeneous-instances",
        type=int,
        metavar="K",
        help="the baseline's local instances (default N + M)",
    )
    f.add_argument("--bandwidth-gbps", type=float, required=True, metavar="B", help="the PrfaaS egress link")
    f.add_argument(
        "--lengths",
        required=True,
        metavar="SPEC",
        help="uncached prompt lengths: 'lognormal:mu=9.9,sigma=1,lo=128,hi=131072' (lo optional) or 'file:PATH' "
        "(a JSON list of lengths, or one per line)",
    )
    f.add_argument("--output-tokens", type=float, required=True, metavar="L", help="mean output length")
    f.add_argument("--slo-tokens-per-s", type=float, required=True, metavar="R", help="decode stream SLO")
    f.add_argument(
        "--chunk", type=int, metavar="C", help="device profiles: prefill chunk (default: one step)"
    )
    f.add_argument(
        "--service",
        choices=("representative", "mean"),
        default="representative",
        help="stage service time: the paper's T(E[L]) or the mean E[T(L)] (default %(default)s)",
    )
    f.add_argument("--search", action="store_true", help="include the grid (the paper's figure 5)")
    f.set_defaults(run=run_plan_prfaas)
    p.set_defaults(run=lambda _args: (p.print_help(sys.stderr), EXIT_USAGE)[1])


def parse_lengths(spec: str) -> Any:
    """The length distribution of ``--lengths``; ``CliError`` saying what a valid one looks like."""
    from xservice.policies.prfaas import EmpiricalLengths, LogNormalLengths

    kind, _, rest = spec.partition(":")
    if kind == "lognormal":
        try:
            kv = dict(item.split("=", 1) for item in rest.split(",") if item)
            args = {k: float(v) for k, v in kv.items()}
            unknown = set(args) - {"mu", "sigma", "lo", "hi"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            if not {"mu", "sigma", "hi"} <= set(args):
                raise ValueError("mu, sigma and hi (the longest prompt) are required")
            return LogNormalLengths(args["mu"], args["sigma"], args.get("lo", 1.0), args.get("hi", math.inf))
        except ValueError as e:
            raise CliError(f"--lengths {spec!r}: {e}; e.g. lognormal:mu=9.9,sigma=1,lo=128,hi=131072") from e
    if kind == "file":
        path = Path(rest)
        try:
            text = path.read_text()
            values = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
            return EmpiricalLengths(tuple(int(v) for v in values))
        except (OSError, ValueError, TypeError) as e:
            raise CliError(f"--lengths {spec!r}: {e}; give a JSON list of lengths or one per line") from e
    raise CliError(f"--lengths {spec!r}: give 'lognormal:mu=..,sigma=..[,lo=..,hi=..]' or 'file:PATH'")


def _profile(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"cannot read profile {path}: {e}") from e
    if not isinstance(data, dict):
        raise CliError(f"profile {path} must hold a JSON object")
    return data


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    from xservice.policies.prfaas import decode_rate, plan, plan_homogeneous, plan_naive, prefill_curve
    from xservice.policies.prfaas.model import Stages

    for flag in (
        "prfaas_instances",
        "local_instances",
        "bandwidth_gbps",
        "output_tokens",
        "slo_tokens_per_s",
    ):
        if not getattr(args, flag) > 0:
            raise CliError(f"--{flag.replace('_', '-')} must be > 0")
    lengths = parse_lengths(args.lengths)
    local, fast = _profile(args.local_profile), _profile(args.prfaas_profile)
    try:
        stages = Stages(
            local=prefill_curve(local, chunk=args.chunk),
            decode=decode_rate(
                local,
                slo_tokens_per_s=args.slo_tokens_per_s,
                context_tokens=lengths.mean() + args.output_tokens / 2,
            ),
            prfaas=prefill_curve(fast, chunk=args.chunk, speedup=args.prfaas_speedup),
            bandwidth_gbps=args.bandwidth_gbps,
            service=args.service,
        )
        homogeneous = args.homogeneous_instances or args.prfaas_instances + args.local_instances
        points = {
            "prfaas_pd": plan(
                stages, lengths, args.output_tokens, args.prfaas_instances, args.local_instances
            ),
            "homogeneous_pd": plan_homogeneous(stages, lengths, args.output_tokens, homogeneous),
            "naive_heterogeneous": plan_naive(
                stages, lengths, args.output_tokens, args.prfaas_instances, args.local_instances
            ),
        }
    except ValueError as e:
        raise CliError(str(e)) from e
    out = {k: v.to_dict() for k, v in points.items()}
    if not args.search:
        out["prfaas_pd"].pop("search", None)
    base = points["homogeneous_pd"].lambda_max
    out["ratio_vs_homogeneous"] = {
        k: round(v.lambda_max / base, 4) if base else None for k, v in points.items()
    }
    out["inputs"] = {
        "prfaas_profile": fast.get("name"),
        "local_profile": local.get("name"),
        "decode": {"max_batch": stages.decode.max_batch, "step_s": round(stages.decode.step_s, 6)},
        "mean_length": round(lengths.mean(), 1),
        "bandwidth_gbps": args.bandwidth_gbps,
        "service": args.service,
    }
    return out


def run_plan_prfaas(args: argparse.Namespace) -> int:
    print(json.dumps(build_report(args), indent=2))
    return 0
