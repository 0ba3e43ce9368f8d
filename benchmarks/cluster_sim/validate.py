"""The simulator against a real emulated cluster on one trace: TTFT and TPOT p50 / p90 of each, and the
simulator's relative error.

An ``xllm serve`` cluster of ``--instances`` emulated engines (``--device emulated`` with ``--profile``;
colocated, or ``--num-prefill`` prefill instances and the rest decode, PD over Mooncake) plays the
trace open-loop through the ``benchmarks/serving`` client (streaming completions of exactly the trace's
prompt lengths, ``max_tokens`` its output lengths, ``ignore_eos``); the simulator runs the same
requests at the same arrival times with the same profile, budget and batch limit, and with what it
leaves out measured apart from the trace first (``calibrate``: nine requests one at a time on the idle
cluster give a request's way in and out, and an engine's host work per step).

    PYTHONPATH=. .venv/bin/python -m benchmarks.cluster_sim.validate --instances 4 --requests 150

``--device cpu`` runs real CPU engines (one thread each) instead, with ``--profile`` measured from the
same model by ``xllm profile engine``; ``--dynamic-start P`` runs dynamic PD from P prefill instances
(``DynamicPDPolicy`` in both); ``--phase`` (twice: ``n=..,in=..,out=..,rate=..``) plays fixed-length
phases back to back instead of the log-normal trace -- the 4-engine dynamic-PD trace of
``benchmarks/dynamic_pd.py``:

    PYTHONPATH=. .venv/bin/python -m benchmarks.cluster_sim.validate --device cpu --profile PROFILE.json \
        --dynamic-start 2 --phase n=48,in=480,out=4,rate=12 --phase n=32,in=24,out=128,rate=4

The emulated side includes what the simulator leaves out (the service, HTTP, the engines' host work
between steps, processes sharing this machine's cores): the error says how much that matters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import yaml

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.cluster_sim.cluster import Cluster, SimConfig
from benchmarks.cluster_sim.trace import LengthMix, SimRequest, make_trace
from benchmarks.server_process import free_port, run_server
from benchmarks.serving.client import RequestSpec, send_request
from benchmarks.serving.dataset import load_tokenizer, normal_token_ids, random_prompt
from benchmarks.smoke import add_smoke_flag, parse_args
from ops.platforms.cpu_features import cpu_features
from ops.platforms.device_profile import load_profile

MODEL_NAME = "xllm-sim-validate"
DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "validation-accelerator.json"
BUDGET, MAX_SEQS, BLOCKS, BLOCK = 2048, 64, 1024, 16
SMOKE = {"requests": 12, "instances": 2, "rate": 4.0}


def prompts_for(model: str, trace: list[SimRequest], seed: int) -> tuple[list[SimRequest], list[str]]:
    """A prompt text per request of the trace's length; the trace with the texts' exact token counts."""
    tok = load_tokenizer(model)
    pool, rng = normal_token_ids(tok), random.Random(seed)
    texts, exact = [], []
    for r in trace:
        text = random_prompt(tok, pool, r.prompt, rng)
        texts.append(text)
        exact.append(
            SimRequest(r.rid, r.arrival, len(tok.encode(text, add_special_tokens=False).ids), r.output)
        )
    return exact, texts


def cluster_config(model: str, profile: str, args: argparse.Namespace, port: int) -> dict:
    cluster: dict = {"registry": {"store": "embedded"}}
    if args.dynamic_start:
        names = [f"p{i}:prefill" for i in range(args.dynamic_start)]
        names += [f"d{i}:decode" for i in range(args.instances - args.dynamic_start)]
        cluster["pd"] = {"mode": "dynamic", "min_decode_instances": 1, "min_prefill_instances": 1}
        cluster["slo"] = {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}
    elif args.num_prefill:
        names = [f"p{i}:prefill" for i in range(args.num_prefill)]
        names += [f"d{i}:decode" for i in range(args.instances - args.num_prefill)]
    else:
        names = [f"m{i}:mixed" for i in range(args.instances)]
    cluster["launch"] = {"instances": ",".join(names)}
    device = (
        {"device": "cpu", "num_threads": 1}
        if args.device == "cpu"
        else {"device": "emulated", "device_profile": profile}
    )
    return {
        "model": {"model": model, "max_model_len": 1100, "seed": 0, "served_model_name": MODEL_NAME},
        "cache": {"block_size": BLOCK, "num_blocks": BLOCKS},
        "scheduler": {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": BUDGET},
        "device": device,
        "service": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "cluster": cluster,
    }


def phase_trace(phases: list[str], seed: int) -> list[SimRequest]:
    """Fixed-length phases back to back, Poisson arrivals at each phase's rate."""
    rng, out, t = random.Random(seed), [], 0.0
    for text in phases:
        ph = {k: float(v) for k, v in (item.split("=") for item in text.split(","))}
        for _ in range(int(ph["n"])):
            t += rng.expovariate(ph["rate"])
            out.append(SimRequest(len(out), t, int(ph["in"]), int(ph["out"])))
    return out


async def calibrate(base_url: str, model: str, profile, length: int, seed: int) -> dict[str, float]:
    """What the simulator leaves out, measured apart from the trace: requests one at a time on the idle
    cluster; TTFT beyond the profile's prefill is a request's way in and out, the gap between later
    tokens beyond its decode step an engine's host work per step, and the first gap beyond that the
    hand-off (with PD: the KV's export and import; about 0 colocated)."""
    lone = [SimRequest(i, 0.0, length, 16) for i in range(9)]
    exact, texts = prompts_for(model, lone, seed + 7919)
    ways, hosts, handoffs = [], [], []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for r, text in zip(exact, texts):
            rec = await send_request(
                session, RequestSpec(base_url, "completions", MODEL_NAME, text, r.prompt, r.output)
            )
            if not rec.success or len(rec.itl_s) < 2:
                raise RuntimeError(f"calibration request failed: {rec.error}")
            ways.append(rec.ttft_s - profile.step_seconds([r.prompt], [r.prompt]))
            step = profile.step_seconds([1], [r.prompt + 8])
            hosts.append(float(np.median(rec.itl_s[1:])) - step)  # the steady gaps between tokens
            handoffs.append(rec.itl_s[0] - step)  # the first gap: with PD, the KV's way over
    host = max(0.0, float(np.median(hosts[1:])))
    return {
        # the least of them: a first token whose text the detokenizer holds back (a partial character)
        # reaches the client a step later, which is the token's, not the way's
        "request_overhead_ms": round(max(0.0, float(np.min(ways[1:]))) * 1000, 3),
        "step_host_ms": round(host * 1000, 3),
        # beyond the transfer the simulator prices: export, import, the decode request's way in
        "handoff_ms": round(max(0.0, float(np.median(handoffs[1:])) - host) * 1000, 3),
    }


async def play(base_url: str, trace: list[SimRequest], texts: list[str]) -> list:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def one(r: SimRequest, text: str):
            await asyncio.sleep(max(0.0, t0 + r.arrival - time.perf_counter()))
            spec = RequestSpec(base_url, "completions", MODEL_NAME, text, r.prompt, r.output)
            return await send_request(session, spec)

        return list(await asyncio.gather(*(one(r, t) for r, t in zip(trace, texts))))


def _pcts(values: list[float]) -> dict[str, float]:
    p50, p90 = np.percentile(values, [50, 90]) if values else (0.0, 0.0)
    return {"p50": round(float(p50), 5), "p90": round(float(p90), 5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_args(ap)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--num-prefill", type=int, default=0, help="prefill instances (0: all colocated)")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--prompt-median", type=float, default=256)
    ap.add_argument("--output-median", type=float, default=32)
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE))
    ap.add_argument("--device", choices=["emulated", "cpu"], default="emulated")
    ap.add_argument(
        "--dynamic-start", type=int, default=0, help="dynamic PD from this many prefill instances"
    )
    ap.add_argument("--ttft-slo-ms", type=float, default=300.0, help="dynamic PD's TTFT SLO")
    ap.add_argument("--tpot-slo-ms", type=float, default=40.0, help="dynamic PD's TPOT SLO")
    ap.add_argument("--phase", action="append", help="n=..,in=..,out=..,rate=.. (repeat; replaces the trace)")
    ap.add_argument("--seed", type=int, default=0)
    add_smoke_flag(ap)
    args = parse_args(ap, argv, SMOKE)
    model = resolve_checkpoint(args)
    profile = load_profile(args.profile)
    raw = (
        phase_trace(args.phase, args.seed)
        if args.phase
        else make_trace(
            "steady",
            args.requests,
            args.rate,
            args.seed,
            LengthMix(args.prompt_median, args.output_median),
            1024,
        )
    )
    trace, texts = prompts_for(model, raw, args.seed)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "cluster.yaml"
        config.write_text(
            yaml.safe_dump(cluster_config(model, str(Path(args.profile).resolve()), args, port))
        )
        cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(config)]
        with run_server(cmd, port, name=f"{args.device}-cluster") as base_url:
            calibration = asyncio.run(calibrate(base_url, model, profile, int(args.prompt_median), args.seed))
            records = asyncio.run(play(base_url, trace, texts))
            admin = httpx.get(f"{base_url.removesuffix('/v1')}/v1/admin/instances", timeout=10).json()
    measured_flips = (
        sum(admin.get("dynamic_pd", {}).get("num_flips", {}).values()) if args.dynamic_start else 0
    )
    failed = [r.error for r in records if not r.success]
    real_ttft = [r.ttft_s for r in records if r.success]
    real_tpot = [r.tpot_s for r in records if r.success and r.tpot_s is not None]
    mode = "dynamic" if args.dynamic_start else "static" if args.num_prefill else "colocated"
    slo = {"ttft_slo_s": args.ttft_slo_ms / 1000, "tpot_slo_s": args.tpot_slo_ms / 1000}
    split = args.dynamic_start or args.num_prefill
    cluster = Cluster(
        SimConfig(
            mode,
            args.instances,
            split,
            budget=BUDGET,
            max_seqs=MAX_SEQS,
            cores=float(os.cpu_count() or 1) if args.device == "cpu" else 0.0,  # CPU engines share them
            **slo,
            **calibration,
        ),
        profile.__class__(**{**profile.__dict__, "kv_capacity_tokens": BLOCKS * BLOCK}),
    )
    sim = cluster.run(trace)
    sim_ttft = [r.first_token - r.req.arrival for r in sim.values() if r.first_token is not None]
    sim_tpot = [
        (r.end - r.first_token) / (r.req.output - 1) for r in sim.values() if r.end and r.req.output > 1
    ]
    real = {"ttft_s": _pcts(real_ttft), "tpot_s": _pcts(real_tpot)}  # the cluster run (emulated or cpu)
    simulated = {"ttft_s": _pcts(sim_ttft), "tpot_s": _pcts(sim_tpot)}
    errors = {
        f"{metric}_{q}": round((simulated[metric][q] - real[metric][q]) / real[metric][q], 4)
        for metric in ("ttft_s", "tpot_s")
        for q in ("p50", "p90")
        if real[metric][q]
    }
    out = {
        "instances": args.instances,
        "mode": mode if not split else f"{mode} {split}P{args.instances - split}D",
        "device": args.device,
        "simulated_cores": os.cpu_count() if args.device == "cpu" else None,  # None: one device each
        "requests": len(trace),
        "num_flips": {"measured": measured_flips, "simulated": cluster.num_flips},
        "rate": round(len(trace) / max(trace[-1].arrival, 1e-9), 3) if args.phase else args.rate,
        "profile": profile.name,
        "host_cpu": cpu_features().model_name,
        "calibration": calibration,
        "measured": real,
        "simulated": simulated,
        "relative_error": errors,
        "failed": len(failed),
        "first_error": failed[0] if failed else None,
    }
    print(json.dumps(out, indent=2))
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
