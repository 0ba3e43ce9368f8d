"""Prefill-as-a-Service for real between two network namespaces (``ci/netns.sh``): the PrfaaS cluster's
emulated instances in their own namespace, its egress shaped with ``tc tbf``, the local PD cluster's in
the root one, KV moved by Mooncake over TCP across the veth pair.

    python -m benchmarks.prfaas.netns [--link-mbit 2] [--cut-mbit 0.3] [--requests 150] [--rate 5]

1. **plan**: the throughput model's search (``xservice/policies/prfaas``) over the two emulated
   profiles, the trace's length distribution and the link gives the threshold;
2. **all-local PD vs PrfaaS-PD** on the same trace (Poisson arrivals at ``--rate``): throughput
   (requests over the makespan) and TTFT p50 / p90;
3. **the link cut**: PrfaaS-PD at ``--cut-rate``, the link lowered from ``--link-mbit`` to
   ``--cut-mbit`` halfway, with the bandwidth-aware scheduler and without; every second the service's
   threshold, egress and backlog and the shaper's own byte count (the link's real utilisation against
   its limit).

Prints JSON. Skips (``"skipped"``, exit 0) where namespaces cannot be made. Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.prfaas.paper import PROFILES
from benchmarks.server_process import free_port, run_server
from benchmarks.serving.client import RequestSpec, send_request
from benchmarks.serving.dataset import random_prompts
from benchmarks.serving.metrics import percentile
from benchmarks.smoke import add_smoke_flag, parse_args
from benchmarks.xllm_server import REPO_ROOT
from xservice.policies.prfaas import LogNormalLengths, decode_rate, plan, prefill_curve
from xservice.policies.prfaas.model import Stages

NETNS = REPO_ROOT / "ci" / "netns.sh"
LOCAL, FAST = PROFILES / "emulated-local.json", PROFILES / "emulated-prfaas.json"
NS, HOST_IP, NS_IP = "xprfaas", "10.77.0.1", "10.77.0.2"
MODEL_NAME = "prfaas-bench"


def netns(*args: str) -> str:
    return subprocess.run(
        [str(NETNS), *args, "--name", NS], check=True, capture_output=True, text=True
    ).stdout


def link_bytes() -> int:
    return int(json.loads(netns("stats"))["sent_bytes"])


def config(
    model: str, port: int, threshold: int | None, link_mbit: float, max_queue_s: float, scheduler: bool = True
) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "launch": {"instances": "p0:prefill,d0:decode"},
        "registry": {"store": "embedded"},
        "slo": {"ttft_ms": 5000.0, "tpot_ms": 100.0},
    }
    if threshold is not None:
        cluster["prfaas"] = {
            "enabled": True, "instances": "prfaas-0", "netns": NS, "engine_host": NS_IP, "store_host": HOST_IP,
            "device_profile": str(FAST), "threshold_tokens": threshold, "link_gbps": link_mbit / 1000,
            "max_queue_s": max_queue_s, "scheduler": scheduler,
        }  # fmt: skip
    return {
        "model": {"model": model, "max_model_len": 1024, "seed": 0, "served_model_name": MODEL_NAME},
        "cache": {"block_size": 16, "num_blocks": 4096},
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
        "device": {"device": "emulated", "device_profile": str(LOCAL)},
        "service": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "cluster": cluster,
    }


def trace(
    model: str, n: int, rate: float, lengths: LogNormalLengths, seed: int
) -> list[tuple[float, str, int]]:
    """(arrival s, prompt, its tokens): Poisson arrivals, log-normal lengths."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for i, want in enumerate(lengths.sample(n, seed=seed)):
        at += rng.expovariate(rate)
        text, tokens = random_prompts(model, 1, max(8, want - 2), seed * 100003 + i)[0]
        out.append((at, text, tokens))
    return out


async def drive(
    base: str, reqs: list[tuple[float, str, int]], output: int, on_half=None, sample=None
) -> dict[str, Any]:
    """Send ``reqs`` at their arrival times; ``on_half`` runs at the middle arrival, ``sample`` every
    second while requests are out."""
    records: list[Any] = [None] * len(reqs)
    start = time.perf_counter()
    done = asyncio.Event()
    half = reqs[len(reqs) // 2][0]

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        at, text, tokens = reqs[i]
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        spec = RequestSpec(base, "completions", MODEL_NAME, text, tokens, output)
        records[i] = await send_request(session, spec)

    async def ticker() -> None:
        fired = False
        while not done.is_set():
            now = time.perf_counter() - start
            if on_half is not None and not fired and now >= half:
                fired = True
                await asyncio.to_thread(on_half)
            if sample is not None:
                await asyncio.to_thread(sample, now)
            await asyncio.sleep(1.0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(one(i, session) for i in range(len(reqs))))
        done.set()
        await tick
    span = time.perf_counter() - start
    ok = [r for r in records if r.success]
    ttft = [r.ttft_s for r in ok]
    return {
        "num_requests": len(reqs),
        "num_failed": len(reqs) - len(ok),
        "throughput_req_s": round(len(ok) / span, 3),
        "ttft_s": {"p50": round(percentile(ttft, 50), 3), "p90": round(percentile(ttft, 90), 3)}
        if ttft
        else None,
        "span_s": round(span, 1),
        "errors": sorted({r.error for r in records if not r.success})[:3],
    }


def run_one(
    model: str, threshold: int | None, link_mbit: float, reqs, args, cut: bool = False, scheduler: bool = True
) -> dict[str, Any]:
    port = free_port()
    cfg = config(model, port, threshold, link_mbit, args.max_queue_s, scheduler)
    path = Path(tempfile.mkstemp(prefix="prfaas-netns-", suffix=".yaml")[1])
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(path)]
    netns("rate", "--rate", f"{link_mbit}mbit")
    samples: list[dict[str, Any]] = []
    with run_server(
        cmd, port, env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}, name="prfaas-netns"
    ) as base:
        admin = httpx.Client(base_url=base.removesuffix("/v1"), timeout=10.0)
        last = {"at": 0.0, "bytes": link_bytes()}
        limit = {"mbit": link_mbit}

        def on_half() -> None:
            netns("rate", "--rate", f"{args.cut_mbit}mbit")
            limit["mbit"] = args.cut_mbit

        def sample(now: float) -> None:
            sent = link_bytes()
            prf = admin.get("/v1/admin/instances").json().get("prfaas") or {}
            link = prf.get("link") or {}
            mbit = (sent - last["bytes"]) * 8 / max(now - last["at"], 1e-3) / 1e6
            last.update(at=now, bytes=sent)
            samples.append({
                "at_s": round(now, 1), "limit_mbit": limit["mbit"], "link_mbit": round(mbit, 3),
                "threshold": prf.get("threshold_tokens"), "egress_mbit": round(link.get("egress_gbps", 0) * 1000, 3),
                "capacity_mbit": round(link.get("capacity_gbps", 0) * 1000, 3), "queue_s": link.get("queue_s"),
            })  # fmt: skip

        out = asyncio.run(
            drive(base, reqs, args.output_tokens, on_half if cut else None, sample if cut else None)
        )
        out["prfaas"] = admin.get("/v1/admin/instances").json().get("prfaas")
    path.unlink(missing_ok=True)
    if cut:
        # whole seconds under the new limit (not the one the cut fell in)
        after = [
            b for a, b in zip(samples, samples[1:]) if a["limit_mbit"] == b["limit_mbit"] == args.cut_mbit
        ]
        out["after_cut"] = {
            "link_mbit_max": max(
                (x["link_mbit"] for x in after), default=0.0
            ),  # the shaper's count, per second
            "limit_mbit": args.cut_mbit,
            "backlog_s_max": max((x["queue_s"] or 0.0 for x in after), default=0.0),
            "threshold_final": after[-1]["threshold"] if after else None,
        }
        out["samples"] = samples
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.prfaas.netns", description=__doc__.split("\n\n")[0]
    )
    add_checkpoint_args(p)
    add_smoke_flag(p)
    p.add_argument(
        "--link-mbit",
        type=float,
        default=2.0,
        help="the PrfaaS link (default 2 Mbit/s: an emulated instance moves 128 bytes of KV a token)",
    )
    p.add_argument("--cut-mbit", type=float, default=0.3, help="the link after the cut (default 0.3)")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rate", type=float, default=5.0, help="arrivals/s of the comparison (default 5)")
    p.add_argument("--cut-rate", type=float, default=3.0, help="arrivals/s of the link-cut run (default 3)")
    p.add_argument("--cut-requests", type=int, default=240)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--median-tokens", type=float, default=256.0)
    p.add_argument("--max-queue-s", type=float, default=2.0, help="cluster.prfaas.max_queue_s")
    p.add_argument("--seed", type=int, default=0)
    args = parse_args(p, argv, {"requests": 24, "cut_requests": 36, "rate": 3.0, "cut_rate": 3.0})
    report: dict[str, Any] = {
        "benchmark": "prfaas.netns",
        "host": {"cpu": platform.processor() or platform.machine()},
    }
    check = subprocess.run([str(NETNS), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        report["skipped"] = f"network namespaces unavailable: {check.stdout.strip() or check.stderr.strip()}"
        print(json.dumps(report, indent=1))
        return 0
    model = resolve_checkpoint(args)
    lengths = LogNormalLengths(math.log(args.median_tokens), 0.8, 32, 1000)
    local, fast = (json.loads(f.read_text()) for f in (LOCAL, FAST))
    stages = Stages(
        local=prefill_curve(local),
        decode=decode_rate(local, slo_tokens_per_s=10.0, context_tokens=lengths.mean()),
        prfaas=prefill_curve(fast),
        bandwidth_gbps=args.link_mbit / 1000,
        service="mean",
    )
    point = plan(stages, lengths, args.output_tokens, 1, 2, splits=[1])
    t = round(point.deployment.threshold)
    report["plan"] = {k: v for k, v in point.to_dict().items() if k != "search"}
    netns("up", "--rate", f"{args.link_mbit}mbit")
    try:
        reqs = trace(model, args.requests, args.rate, lengths, args.seed)
        report["same_trace"] = {
            "rate_req_s": args.rate,
            "all_local_pd": run_one(model, None, args.link_mbit, reqs, args),
            "prfaas_pd": run_one(model, t, args.link_mbit, reqs, args),
        }
        cut_reqs = trace(model, args.cut_requests, args.cut_rate, lengths, args.seed + 1)
        report["link_cut"] = {
            "rate_req_s": args.cut_rate,
            "link_mbit": [args.link_mbit, args.cut_mbit],
            "with_scheduler": run_one(model, t, args.link_mbit, cut_reqs, args, cut=True),
            "without_scheduler": run_one(model, t, args.link_mbit, cut_reqs, args, cut=True, scheduler=False),
        }
    finally:
        netns("down")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
