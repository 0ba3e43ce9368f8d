"""``xllm profile epd``: measure a vision-language model's stage costs on this machine, find Algorithm 1's
per-step budgets under the TPOT SLO, and choose the EPD strategy and instance counts with the highest
predicted goodput for a workload (``xservice/cluster/epd/profiler.py``; docs/multimodal.md, "EPD profiler").

The model runs in one child process (``xengine.tools.profile_epd``), loaded once: the CLI stays
torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from xservice.cluster.epd.workload import parse_image_size, parse_rate
from xservice.commands.common import EXIT_USAGE, CliError
from xservice.commands.profile_engine import register_profile_engine


def register_profile(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="profilers (epd, engine)", description="Profilers.")
    tools = p.add_subparsers(title="profile commands", metavar="COMMAND")
    e = tools.add_parser(
        "epd",
        help="choose an EPD strategy and instance counts from stage costs measured here",
        description="Measure encode / prefill / decode costs of a vision-language model on this machine, "
        "binary-search Algorithm 1's encode batch (scheduler.max_encode_images) and token budget "
        "(scheduler.max_num_batched_tokens) under the TPOT SLO over real steps, and rank E+P+D, EP+D, "
        "ED+P and colocated EPD over every split of the instances by predicted goodput.",
    )
    e.add_argument("--model", required=True, metavar="DIR", help="vision-language model folder")
    e.add_argument("--workload", choices=("image-heavy", "text-heavy"), help="a named workload description")
    e.add_argument("--images-per-request", type=int, metavar="K", help="custom workload: images per request")
    e.add_argument("--image-size", metavar="WxH", help="custom workload: image resolution, e.g. 448x448")
    e.add_argument("--prompt-tokens", type=int, metavar="P", help="custom workload: text tokens per prompt")
    e.add_argument("--output-tokens", type=int, metavar="O", help="custom workload: output tokens")
    e.add_argument("--request-rate", default="max", help="offered requests/s, or 'max' (default)")
    e.add_argument("--ttft-slo-ms", type=float, required=True, metavar="X")
    e.add_argument("--tpot-slo-ms", type=float, required=True, metavar="Y")
    e.add_argument("--instances", type=int, required=True, metavar="N", help="instances to split into pools")
    e.add_argument("--threads", type=int, metavar="T", help="engine threads (default: the engine's)")
    e.add_argument(
        "--cores",
        type=float,
        metavar="C",
        help="the instances share C cores (slows them down when busy together; default: one core each)",
    )
    e.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median; default 3)")
    e.add_argument(
        "--decode-batch", type=int, metavar="B", help="budgets at B decodes (default: chosen deployment's)"
    )
    e.add_argument(
        "--max-encode-images", type=int, default=32, help="upper end of the τ_e search (default 32)"
    )
    e.add_argument("--max-prefill-tokens", type=int, default=4096, help="upper end of the τ_t search")
    e.add_argument("--max-batch", type=int, default=16, help="largest decode batch measured (default 16)")
    e.add_argument("--max-images", type=int, default=8, help="largest encode batch measured (default 8)")
    e.add_argument(
        "--transfer-gbs",
        type=float,
        metavar="G",
        help="E→P / P→D bandwidth in GB/s (default: measured loopback)",
    )
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.set_defaults(run=run_profile_epd)
    register_profile_engine(tools)
    p.set_defaults(run=lambda _args: (p.print_help(sys.stderr), EXIT_USAGE)[1])


def build_request(args: argparse.Namespace) -> Any:
    """The ``ProfileRequest`` of the flags; ``CliError`` naming the flag that is wrong."""
    from xservice.cluster.epd.profiler import WORKLOADS, ProfileRequest
    from xservice.policies.epd import EPDSLO

    if not (Path(args.model) / "config.json").is_file():
        raise CliError(f"--model {args.model!r}: no config.json there; pass a vision-language model folder")
    custom = {
        k: getattr(args, k) for k in ("images_per_request", "image_size", "prompt_tokens", "output_tokens")
    }
    given = [k for k, v in custom.items() if v is not None]
    if args.workload and given:
        raise CliError(
            f"--workload {args.workload} and --{given[0].replace('_', '-')}: give one or the other"
        )
    if args.workload:
        spec = dict(WORKLOADS[args.workload])
    elif len(given) == len(custom):
        spec = {**custom, "image_size": _size(args.image_size)}
    else:
        missing = [f"--{k.replace('_', '-')}" for k in custom if k not in given]
        raise CliError(f"give --workload, or all of {', '.join(missing)} for a custom workload")
    for name in ("images_per_request", "prompt_tokens"):
        if spec[name] < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0")
    for flag, value in (("--output-tokens", spec["output_tokens"]), ("--instances", args.instances),
                        ("--repeats", args.repeats), ("--max-batch", args.max_batch), ("--max-images", args.max_images),
                        ("--max-encode-images", args.max_encode_images)):  # fmt: skip
        if value < 1:
            raise CliError(f"{flag} must be >= 1, got {value}")
    if args.ttft_slo_ms <= 0 or args.tpot_slo_ms <= 0:
        raise CliError("--ttft-slo-ms and --tpot-slo-ms must be > 0")
    if args.cores is not None and not args.cores > 0:
        raise CliError(f"--cores must be > 0, got {args.cores}")
    if args.decode_batch is not None and args.decode_batch < 0:
        raise CliError("--decode-batch must be >= 0")
    return ProfileRequest(
        model=str(Path(args.model).resolve()),
        slo=EPDSLO(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3),
        num_instances=args.instances,
        request_rate=_rate(args.request_rate),
        threads=args.threads,
        repeats=args.repeats,
        decode_batch=args.decode_batch,
        max_encode_images=args.max_encode_images,
        max_prefill_tokens=args.max_prefill_tokens,
        max_batch=args.max_batch,
        max_images=args.max_images,
        transfer_bytes_per_s=args.transfer_gbs * 1e9 if args.transfer_gbs else None,
        cores=args.cores,
        **spec,
    )


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_image_size(text, "--image-size")
    except ValueError as e:
        raise CliError(str(e)) from None


def _rate(text: str) -> float | None:
    try:
        return parse_rate(text, "--request-rate")
    except ValueError as e:
        raise CliError(str(e)) from None


def run_profile_epd(args: argparse.Namespace) -> int:
    from rich.console import Console

    from xservice.cluster.epd.profiler import ProbeError, run_profile

    req = build_request(args)
    err = Console(stderr=True)
    try:
        if args.json:
            report = run_profile(req)
        else:
            with err.status("measuring") as status:
                report = run_profile(req, lambda what: status.update(f"measuring: {what}"))
    except ProbeError as e:
        raise CliError(f"profiling failed: {e}") from e
    except ValueError as e:
        raise CliError(f"profiling failed: {e}") from e
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console() if sys.stdout.isatty() else Console(width=160)
    for part in render_report(report):
        console.print(part)
    return 0


def render_report(doc: dict[str, Any]) -> list[Any]:
    """The report as rich renderables: machine and workload, costs, budgets, the ranked strategies."""
    from rich.table import Table

    m, w, slo, b = doc["machine"], doc["workload"], doc["slo"], doc["budgets"]
    rate = "max" if w["request_rate"] is None else f"{w['request_rate']:g} req/s"
    out: list[Any] = [
        f"[bold]{m['model']}[/] on {m['device']}, {m['num_threads']} threads, {m['dtype']}; "
        f"encode steps: {m['encode_mode']}, encode/language overlap {'on' if m['encode_overlap'] else 'off'}",
        f"workload: {w['images_per_request']} image(s) of {w['image_size'][0]}x{w['image_size'][1]} "
        f"({w['image_tokens_per_image']} tokens, {w['patches_per_image']} patches each), {w['prompt_tokens']} text "
        f"+ {w['prompt_len'] - w['prompt_tokens']} image prompt tokens, {w['output_tokens']} output; rate {rate}; "
        f"SLO TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms; {doc['instances']} instances",
    ]
    if doc.get("cores"):
        out.append(f"the instances share {doc['cores']:g} cores: busy together, they slow each other down")
    costs = Table(title="fitted stage costs (median of measured repeats)")
    for col in ("stage", "model", "coefficients"):
        costs.add_column(col)
    for stage in ("encode", "prefill", "decode"):
        c = doc["costs"][stage]
        costs.add_row(stage, c["model"], ", ".join(f"{x:.3e}" for x in c["coef"]))
    t = doc["costs"]["transfer"]
    costs.add_row(
        "transfer", "s = bytes / bw", f"{t['bytes_per_s'] / 1e9:.2f} GB/s; embed {t['embed_bytes_per_token']:.0f} B/token, "
        f"KV {t['kv_bytes_per_token']:.0f} B/token",
    )  # fmt: skip
    out.append(costs)
    budgets = Table(
        title=f"Algorithm 1 budgets at {b['decode_batch']} decodes on {b['context_tokens_per_seq']}-token contexts"
    )
    for col in ("search over", "τ_e (images)", "τ_t (tokens)", "decodes alone", "engine config"):
        budgets.add_column(col)
    for kind in ("measured", "model"):
        x = b[kind]
        cfg = "  ".join(f"{k}: {v}" for k, v in x["config"].items())
        budgets.add_row(
            f"{kind} steps ({len(x['probes'])})",
            str(x["tau_e"]),
            str(x["tau_t"]),
            f"{x['decode_only_s'] * 1e3:.2f} ms",
            cfg,
        )
    out.append(budgets)
    table = Table(title="strategies by predicted goodput (requests/s meeting both SLOs)")
    for col in ("strategy", "instances", "goodput", "TTFT ms", "TPOT ms", "limited by"):
        table.add_column(col)
    for row in doc["strategies"]:
        table.add_row(
            row["strategy"], " ".join(f"{k}:{v}" for k, v in row["counts"].items()), f"{row['goodput']:.3f}",
            _ms(row["ttft_s"]), _ms(row["tpot_s"]), row["limit"],
        )  # fmt: skip
    out.append(table)
    c = doc["choice"]
    counts = ", ".join(f"{v} {k}" for k, v in c["counts"].items())
    out.append(f"[bold]choice: {c['strategy']} ({counts}), predicted goodput {c['goodput']:.3f} req/s[/]")
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
