"""Dynamic PD vs every static P/D split of the same instances, on one trace whose mix shifts.

The trace has two phases played back to back with Poisson arrivals: (A) prefill-heavy (long prompts,
short outputs), then (B) decode-heavy (short prompts, long outputs). Each configuration is a real
``xllm serve`` cluster of the same ``--instances`` engines (1 thread each) with the embedded store and
Mooncake KV transfer: ``static`` with P prefill + (N - P) decode instances for every P, and
``dynamic`` (``cluster.pd_mode: dynamic``) starting from ``--dynamic-start`` prefill instances.
A request attains the SLO when its TTFT and its TPOT both meet theirs (a failed request does not).

    PYTHONPATH=. .venv/bin/python -m benchmarks.dynamic_pd --size tiny

prints ``{"trace": {...}, "static": [{"num_prefill": P, "num_decode": D, "slo_attainment": x}, ...],
"dynamic": {"slo_attainment": y, "num_flips": n, ...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.server_process import free_port, run_server
from benchmarks.serving.client import RequestSpec, send_request
from benchmarks.serving.dataset import random_prompts
from benchmarks.serving.metrics import RequestRecord, meets_slos, percentile
from benchmarks.xllm_server import REPO_ROOT

MODEL_NAME = "xllm-bench"


def parse_phase(text: str) -> dict[str, float]:
    """``n=40,in=400,out=4,rate=20`` -> dict (n requests, input/output tokens, arrivals per second)."""
    out = {k: float(v) for k, v in (item.split("=") for item in text.split(","))}
    missing = {"n", "in", "out", "rate"} - set(out)
    if missing:
        raise SystemExit(f"phase {text!r} lacks {', '.join(sorted(missing))}")
    return out


def build_trace(
    tokenizer_dir: str, phases: list[dict[str, float]], seed: int
) -> list[tuple[float, RequestSpec]]:
    """(send time from the start, request) for every request of every phase, in order."""
    rng = random.Random(seed)
    trace, t = [], 0.0
    for i, ph in enumerate(phases):
        prompts = random_prompts(tokenizer_dir, int(ph["n"]), int(ph["in"]), seed=seed + i)
        for text, n in prompts:
            t += rng.expovariate(ph["rate"])
            spec = RequestSpec("", "completions", MODEL_NAME, text, n, int(ph["out"]))
            trace.append((t, spec))
    return trace


def cluster_config(model: str, port: int, num_prefill: int, args: argparse.Namespace, dynamic: bool) -> dict:
    names = [f"p{i}" for i in range(num_prefill)] + [f"d{i}" for i in range(args.instances - num_prefill)]
    roles = [("prefill" if n.startswith("p") else "decode") for n in names]
    cluster: dict[str, Any] = {
        "instances": ",".join(f"{n}:{r}" for n, r in zip(names, roles)),
        "metadata_store": "embedded",
        "pd_mode": "dynamic" if dynamic else "static",
    }
    if dynamic:
        cluster.update(
            ttft_slo_ms=args.ttft_slo_ms,
            tpot_slo_ms=args.tpot_slo_ms,
            min_decode_instances=args.min_decode,
            min_prefill_instances=1,
            flip_cooldown_s=args.flip_cooldown_s,
        )
    return {
        "model": {
            "model": model,
            "max_model_len": args.max_model_len,
            "seed": 0,
            "served_model_name": MODEL_NAME,
        },
        "cache": {"block_size": 16, "num_blocks": args.num_blocks, "kv_transfer_port_range": "24100-24399"},
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
        "device": {"device": "cpu", "num_threads": 1},
        "service": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "cluster": cluster,
    }


async def play(base_url: str, trace: list[tuple[float, RequestSpec]]) -> tuple[list[RequestRecord], float]:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(at: float, spec: RequestSpec) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await send_request(session, dataclasses.replace(spec, base_url=base_url))

        records = await asyncio.gather(*(one(at, spec) for at, spec in trace))
        return list(records), time.perf_counter() - t0


def attainment(records: list[RequestRecord], slos: dict[str, float]) -> float:
    return sum(1 for r in records if r.success and meets_slos(r, slos)) / max(1, len(records))


def summarize(records: list[RequestRecord], phases: list[dict[str, float]], slos: dict[str, float]) -> dict:
    out: dict[str, Any] = {
        "slo_attainment": attainment(records, slos),
        "failed": sum(not r.success for r in records),
    }
    start = 0
    for name, ph in zip("AB", phases):
        part = records[start : start + int(ph["n"])]
        start += int(ph["n"])
        done = [r for r in part if r.success]
        out[f"phase_{name}"] = {
            "slo_attainment": attainment(part, slos),
            "ttft_p50_ms": percentile([r.ttft_s * 1000 for r in done], 50),
            "ttft_p99_ms": percentile([r.ttft_s * 1000 for r in done], 99),
            "tpot_p50_ms": percentile([(r.tpot_s or 0) * 1000 for r in done], 50),
            "tpot_p99_ms": percentile([(r.tpot_s or 0) * 1000 for r in done], 99),
        }
    return out


def run_config(model: str, num_prefill: int, dynamic: bool, trace: list, args: argparse.Namespace) -> dict:
    port = free_port()
    cfg = cluster_config(model, port, num_prefill, args, dynamic)
    path = Path(tempfile.mkstemp(prefix="xllm-dynpd-", suffix=".yaml")[1])
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(path)]
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    label = f"{'dynamic' if dynamic else 'static'} {num_prefill}P{args.instances - num_prefill}D"
    with run_server(cmd, port, env=env, name=f"xllm-{label.replace(' ', '-')}") as base_url:
        admin = f"http://127.0.0.1:{port}/v1/admin/instances"
        if dynamic:  # let start-up profiling finish (it is part of start-up, not of the trace)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                insts = httpx.get(admin, timeout=10).json()["instances"]
                if all(i.get("predictors", {}).get("ttft", {}).get("num_samples", 0) >= 3 for i in insts):
                    break
                time.sleep(0.5)
        warm = [(0.05 * i, spec) for i, (_, spec) in enumerate(trace[:: max(1, len(trace) // 8)])]
        asyncio.run(play(base_url, warm))
        records, duration = asyncio.run(play(base_url, trace))
        doc = httpx.get(admin, timeout=10).json()
    path.unlink(missing_ok=True)
    slos = {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms}
    out = {"num_prefill": num_prefill, "num_decode": args.instances - num_prefill, "duration_s": duration}
    out.update(summarize(records, args.phases, slos))
    if dynamic:
        dyn = doc["dynamic_pd"]
        out["num_flips"] = sum(dyn["num_flips"].values())
        out["flips_by_direction"] = dyn["num_flips"]
        out["flips"] = [
            {"instance": f["instance"], "to": f["to_role"], "reason": f["reason"]} for f in dyn["flips"]
        ]
        out["final_pools"] = dyn["pools"]
        out["kept_on_prefill"] = doc["pd"].get("num_kept_on_prefill", 0)
    print(f"{label}: SLO attainment {out['slo_attainment']:.2f}", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--phase-a", default="n=48,in=480,out=4,rate=12", help="prefill-heavy phase")
    p.add_argument("--phase-b", default="n=32,in=24,out=128,rate=4", help="decode-heavy phase")
    p.add_argument("--ttft-slo-ms", type=float, default=300.0)
    p.add_argument("--tpot-slo-ms", type=float, default=40.0)
    p.add_argument("--static", default="1,2,3", help="prefill instance counts of the static splits")
    p.add_argument("--dynamic-start", type=int, default=2, help="prefill instances dynamic PD starts with")
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--flip-cooldown-s", type=float, default=3.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = resolve_checkpoint(args)
    args.phases = [parse_phase(args.phase_a), parse_phase(args.phase_b)]
    trace = build_trace(model, args.phases, args.seed)
    static = [run_config(model, int(n), False, trace, args) for n in args.static.split(",") if n]
    dynamic = run_config(model, args.dynamic_start, True, trace, args)
    best = max(static, key=lambda s: s["slo_attainment"])
    result = {
        "trace": {
            "phases": {name: ph for name, ph in zip("AB", args.phases)},
            "num_requests": len(trace),
            "slo_ms": {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms},
            "instances": args.instances,
            "threads_per_instance": 1,
            "model": model,
        },
        "static": static,
        "dynamic": dynamic,
        "best_static": f"{best['num_prefill']}P{best['num_decode']}D",
        "dynamic_vs_best_static": dynamic["slo_attainment"] - best["slo_attainment"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
