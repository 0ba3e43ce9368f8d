"""Serving load benchmark against any OpenAI-compatible server; prints one JSON document.

Metric definitions follow vLLM's benchmark_serving (see ``benchmarks/serving/metrics.py``).

    python -m benchmarks.serve --base-url http://127.0.0.1:8000/v1 --tokenizer MODEL_DIR \
        --num-prompts 64 --input-len 128 --output-len 64 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field

import aiohttp

from benchmarks.serving.client import RequestSpec, send_request
from benchmarks.serving.dataset import random_prompts
from benchmarks.serving.load import LoadShape, run_load
from benchmarks.serving.metrics import compute_metrics

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class ServeConfig:
    """One serving benchmark run."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    endpoint: str = "completions"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    shape: LoadShape = field(default_factory=LoadShape)
    tokenizer: str | None = None
    ignore_eos: bool = True
    slos_ms: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    api_key: str | None = None
    num_warmups: int = 1


async def first_model(base_url: str, api_key: str | None) -> str:
    """The id of the first model listed by ``GET {base_url}/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as s, s.get(f"{base_url}/models", headers=headers) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run_serving_benchmark(cfg: ServeConfig) -> dict:
    """Warm up, run the load, and return the metrics plus the config as one dict."""
    model = cfg.model or await first_model(cfg.base_url, cfg.api_key)
    prompts = random_prompts(cfg.tokenizer, cfg.num_prompts, cfg.input_len, cfg.seed)
    specs = [
        RequestSpec(cfg.base_url, cfg.endpoint, model, text, n, cfg.output_len, cfg.ignore_eos, cfg.api_key)
        for text, n in prompts
    ]
    async with aiohttp.ClientSession() as session:
        for _ in range(cfg.num_warmups):
            warm = await send_request(
                session, dataclasses.replace(specs[0], output_len=min(cfg.output_len, 4))
            )
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
    records, duration = await run_load(specs, cfg.shape, cfg.seed)
    config = dataclasses.asdict(cfg) | {"model": model}
    config.pop("api_key")
    config["shape"]["request_rate"] = (
        str(cfg.shape.request_rate) if math.isinf(cfg.shape.request_rate) else cfg.shape.request_rate
    )
    return {"config": config, **compute_metrics(records, duration, cfg.slos_ms)}


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        slos[key] = float(value)
    return slos


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API root, ending in /v1")
    p.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument(
        "--tokenizer", default=None, help="model folder with tokenizer.json for exact-length prompts"
    )
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--goodput", nargs="*", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2e:5000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-warmups", type=int, default=1)
    return p


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Map parsed arguments onto a ``ServeConfig``."""
    return ServeConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        shape=LoadShape(args.request_rate, args.burstiness, args.max_concurrency),
        tokenizer=args.tokenizer,
        ignore_eos=args.ignore_eos,
        slos_ms=parse_slos(args.goodput),
        seed=args.seed,
        api_key=args.api_key,
        num_warmups=args.num_warmups,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its JSON."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asyncio.run(run_serving_benchmark(cfg)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
