"""Dynamic PD vs every static P/D split of the same instances, on one trace whose mix shifts.

The trace has two phases played back to back with Poisson arrivals: (A) prefill-heavy (long prompts,
short outputs), then (B) decode-heavy (short prompts, long outputs). Each configuration is a real
``xllm serve`` cluster of the same ``--instances`` engines (1 thread each), roles in a real etcd
(``--store embedded``: the service's own store), KV over Mooncake, requests through the
``benchmarks/serving`` client: ``static`` with P prefill + (N - P) decode instances for every P of ``--static``
(``all``: 1 .. N-1), ``dynamic`` (``cluster.pd.mode: dynamic``) starting from ``--dynamic-start`` prefill
instances, and ``colocated`` (every instance mixed). A request attains the SLO when its TTFT and its
TPOT both meet theirs (a failed request does not); goodput is the requests attaining it per second.
Arrivals are Poisson, or gamma with ``--burstiness`` (its shape: under 1 is bursty).

``--concurrent`` configurations are up at once (idle ones cost nothing; default all, fewer where
their engines would not fit in memory) and play ``--rounds`` rounds: each round is a fresh trace (new prompts, so no prefix-cache hit carries over), played against every
configuration in turn, the order rotated per round, so slow spells of a shared machine spread over
all of them. Dynamic PD's roles are reset to its start split before each round (operator flips, then
the flip cooldown). A configuration's ``slo_attainment`` is the median over its rounds.

    PYTHONPATH=. .venv/bin/python -m benchmarks.dynamic_pd --size small

prints ``{"trace": {...}, "static": [{"num_prefill": P, "num_decode": D, "slo_attainment": x, "goodput": g},
...], "dynamic": {"slo_attainment": y, "goodput": g, "num_flips": n, ...}, "colocated": {...}}``; every flip with its
direction and its time from the trace start (``trace.phase_switch_s``: when phase B's arrivals begin;
``docs/dynamic_pd.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.etcd_process import run_etcd
from benchmarks.server_process import free_port, run_server
from benchmarks.serving.client import RequestSpec, send_request
from benchmarks.serving.dataset import random_prompts
from benchmarks.serving.metrics import RequestRecord, meets_slos, percentile
from benchmarks.smoke import add_smoke_flag, parse_args
from benchmarks.xllm_server import REPO_ROOT

MODEL_NAME = "xllm-bench"
KV_PORTS_PER_DEPLOYMENT = 64


@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_len: int
    output_len: int
    slo_ms: dict[str, float]  # {"ttft": ms, "tpot": ms}: sent with it (``extra_body.slo``), judged by it


@dataclass
class Deployment:
    num_prefill: int  # 0: colocated (every instance mixed)
    dynamic: bool
    port: int = 0

    @property
    def label(self) -> str:
        if not self.num_prefill:
            return "colocated"
        return f"{'dynamic' if self.dynamic else 'static'}-{self.num_prefill}P"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/admin/instances"


def parse_phase(text: str) -> dict[str, float]:
    """``n=40,in=400,out=4,rate=20[,ttft=MS,tpot=MS]`` -> dict (n requests, input/output tokens,
    arrivals per second, the phase's own SLOs: default ``--ttft-slo-ms`` / ``--tpot-slo-ms``)."""
    out = {k: float(v) for k, v in (item.split("=") for item in text.split(","))}
    missing = {"n", "in", "out", "rate"} - set(out)
    if missing:
        raise SystemExit(f"phase {text!r} lacks {', '.join(sorted(missing))}")
    return out


def build_trace(
    tokenizer_dir: str, phases: list[dict[str, float]], seed: int, burstiness: float = 1.0
) -> list[tuple[float, Request]]:
    """(send time from the start, request) for every request of every phase, in order; gaps are gamma
    with shape ``burstiness`` (1: Poisson) and the phase's mean rate."""
    rng = random.Random(seed)
    trace, t = [], 0.0
    for i, ph in enumerate(phases):
        for text, n in random_prompts(tokenizer_dir, int(ph["n"]), int(ph["in"]), seed=seed + i):
            t += rng.gammavariate(burstiness, 1.0 / (burstiness * ph["rate"]))
            trace.append((t, Request(text, n, int(ph["out"]), {"ttft": ph["ttft"], "tpot": ph["tpot"]})))
    return trace


def cluster_config(model: str, dep: Deployment, index: int, args: argparse.Namespace) -> dict:
    names = [f"p{i}" for i in range(dep.num_prefill)] + [
        f"d{i}" for i in range(args.instances - dep.num_prefill)
    ]
    roles = {"p": "prefill", "d": "decode"} if dep.num_prefill else {"d": "mixed"}
    cluster: dict[str, Any] = {
        "launch": {"instances": ",".join(f"{n}:{roles[n[0]]}" for n in names)},
        "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
        "pd": {
            "mode": "dynamic" if dep.dynamic else "static",
            "min_decode_instances": args.min_decode,
            "min_prefill_instances": 1,
            "flip_cooldown_s": args.flip_cooldown_s,
        },
        "registry": {"store": "embedded"},
    }
    if args.etcd_endpoint:
        cluster["registry"] = {
            "store": "etcd",
            "etcd_endpoint": args.etcd_endpoint,
            "key_prefix": f"/xllm-bench-{index}",
        }
    first = 24100 + index * KV_PORTS_PER_DEPLOYMENT  # a port range per deployment: they run side by side
    return {
        "model": {
            "model": model,
            "max_model_len": args.max_model_len,
            "seed": 0,
            "served_model_name": MODEL_NAME,
        },
        "cache": {
            "block_size": 16,
            "num_blocks": args.num_blocks,
            "kv_transfer_port_range": f"{first}-{first + KV_PORTS_PER_DEPLOYMENT - 1}",
        },
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
        "device": (
            {"device": "emulated", "device_profile": str(Path(args.emulated).resolve())}
            if args.emulated
            else {"device": "cpu", "num_threads": 1}
        ),
        "service": {"host": "127.0.0.1", "port": dep.port, "log_level": "warning"},
        "cluster": cluster,
    }


def spec_of(base_url: str, req: Request) -> RequestSpec:
    """``req`` as a streaming greedy completion carrying its own SLO (``slo`` in the body)."""
    slo = {"ttft_ms": req.slo_ms["ttft"], "tpot_ms": req.slo_ms["tpot"]}
    return RequestSpec(
        base_url, "completions", MODEL_NAME, req.prompt, req.prompt_len, req.output_len, extra={"slo": slo}
    )


async def play(base_url: str, trace: list[tuple[float, Request]]) -> tuple[list[RequestRecord], float, float]:
    """Send ``trace`` open-loop (timed as ``benchmarks/serving`` times a request); (records, duration,
    wall-clock start)."""
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0, wall0 = time.perf_counter(), time.time()

        async def one(at: float, req: Request) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await send_request(session, spec_of(base_url, req))

        records = await asyncio.gather(*(one(at, req) for at, req in trace))
        return list(records), time.perf_counter() - t0, wall0


def attainment(records: list[RequestRecord], slos: dict[str, float]) -> float:
    return sum(1 for r in records if r.success and meets_slos(r, slos)) / max(1, len(records))


def summarize(records: list[RequestRecord], phases: list[dict[str, float]]) -> dict:
    out: dict[str, Any] = {"slo_attainment": 0.0, "failed": sum(not r.success for r in records)}
    start = 0
    for name, ph in zip("AB", phases):
        part = records[start : start + int(ph["n"])]
        start += int(ph["n"])
        slos = {"ttft": ph["ttft"], "tpot": ph["tpot"]}
        out["slo_attainment"] += attainment(part, slos) * len(part) / max(1, len(records))
        done = [r for r in part if r.success]
        out[f"phase_{name}"] = {
            "slo_attainment": attainment(part, slos),
            "ttft_met": sum(r.ttft_s * 1000 <= slos["ttft"] for r in done) / max(1, len(part)),
            "tpot_met": sum((r.tpot_s or 0) * 1000 <= slos["tpot"] for r in done) / max(1, len(part)),
            "ttft_p50_ms": round(percentile([r.ttft_s * 1000 for r in done], 50), 1),
            "ttft_p90_ms": round(percentile([r.ttft_s * 1000 for r in done], 90), 1),
            "tpot_p50_ms": round(percentile([(r.tpot_s or 0) * 1000 for r in done], 50), 1),
            "tpot_p90_ms": round(percentile([(r.tpot_s or 0) * 1000 for r in done], 90), 1),
        }
    return out


def reset_roles(dep: Deployment, cooldown_s: float) -> None:
    """Flip dynamic PD's instances back to their launch roles (operator flips), then sit out the cooldown."""
    flipped = True
    while flipped:
        flipped = False
        for inst in httpx.get(dep.admin, timeout=10).json()["instances"]:
            if inst.get("role") != inst.get("origin"):
                url = f"{dep.admin}/{inst['name']}/role"
                r = httpx.post(url, json={"role": inst["origin"], "reason": "benchmark reset"}, timeout=10)
                flipped = flipped or r.status_code == 200
    time.sleep(cooldown_s + 0.5)


def wait_profiled(dep: Deployment, num_instances: int) -> dict:
    """Wait for start-up profiling (part of start-up, not of the trace); the predictors it seeded."""
    deadline = time.monotonic() + 180
    while True:
        insts = httpx.get(dep.admin, timeout=10).json()["instances"]
        seeded = [i for i in insts if i.get("predictors", {}).get("profile_s") is not None]
        if len(seeded) >= num_instances or time.monotonic() > deadline:
            keys = ("ttft", "tpot", "profile_s")
            return {i["name"]: {k: i.get("predictors", {}).get(k) for k in keys} for i in insts}
        time.sleep(0.5)


def run_round(dep: Deployment, trace: list, warm: list, switch_s: float, args: argparse.Namespace) -> dict:
    base_url = f"http://127.0.0.1:{dep.port}/v1"
    asyncio.run(play(base_url, warm))
    if dep.dynamic:  # after the warm-up, which may flip too
        reset_roles(dep, args.flip_cooldown_s)
    time.sleep(1.0)
    records, duration, wall0 = asyncio.run(play(base_url, trace))
    out: dict[str, Any] = {"duration_s": round(duration, 1)}
    out.update(summarize(records, args.phases))
    out["goodput"] = round(out["slo_attainment"] * len(records) / duration, 3) if duration > 0 else 0.0
    if dep.dynamic:
        full = httpx.get(dep.admin, timeout=10).json()
        doc = full["dynamic_pd"]
        out["kept_on_prefill_so_far"] = full.get("pd", {}).get("num_kept_on_prefill", 0)  # all rounds
        out["flips"] = [
            {
                "instance": f["instance"],
                "direction": "D→P" if f["to_role"] == "prefill" else "P→D",
                "t_s": round(f["at"] - wall0, 2),
                "phase": "A" if f["at"] - wall0 < switch_s else "B",
                "reason": f["reason"],
            }
            for f in doc["flips"]
            if wall0 <= f["at"] <= wall0 + duration
        ]
        out["final_pools"] = doc["pools"]
    return out


def aggregate(dep: Deployment, rounds: list[dict], args: argparse.Namespace) -> dict:
    med = statistics.median
    out: dict[str, Any] = {
        "num_prefill": dep.num_prefill,
        "num_decode": args.instances - dep.num_prefill,
        "slo_attainment": med(r["slo_attainment"] for r in rounds),
        "slo_attainment_rounds": [round(r["slo_attainment"], 3) for r in rounds],
        "goodput": med(r["goodput"] for r in rounds),
        "phase_A_attainment": med(r["phase_A"]["slo_attainment"] for r in rounds),
        "phase_B_attainment": med(r["phase_B"]["slo_attainment"] for r in rounds),
        "failed": sum(r["failed"] for r in rounds),
        "rounds": rounds,
    }
    if dep.dynamic:
        flips = [f for r in rounds for f in r["flips"]]
        out["num_flips"] = len(flips)
        out["flips_by_phase"] = {
            ph: {d: sum(f["phase"] == ph and f["direction"] == d for f in flips) for d in ("D→P", "P→D")}
            for ph in "AB"
        }
    return out


SMOKE = dict(
    instances=2, phase_a="n=2,in=16,out=2,rate=50", phase_b="n=2,in=8,out=4,rate=50", static="1",
    dynamic_start=1, flip_cooldown_s=0.5, rounds=1, store="embedded", max_model_len=256, num_blocks=128,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--phase-a", default="n=48,in=480,out=4,rate=12", help="prefill-heavy phase")
    p.add_argument("--phase-b", default="n=32,in=24,out=128,rate=4", help="decode-heavy phase")
    p.add_argument("--ttft-slo-ms", type=float, default=300.0)
    p.add_argument("--tpot-slo-ms", type=float, default=40.0)
    p.add_argument(
        "--static", default="all", help="prefill instance counts of the static splits (all: 1 .. N-1)"
    )
    p.add_argument("--no-colocated", action="store_true", help="leave out the colocated deployment")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--concurrent", type=int, default=0, help="deployments up at once (0: all)")
    p.add_argument("--dynamic-start", type=int, default=2, help="prefill instances dynamic PD starts with")
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--flip-cooldown-s", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (fresh trace each)")
    p.add_argument("--store", choices=["etcd", "embedded"], default="etcd", help="metadata store")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--emulated",
        metavar="PROFILE",
        help="run every instance on an emulated accelerator of this device profile (docs/emulated.md): "
        "each its own device, however few cores this machine has",
    )
    add_smoke_flag(p)
    return p


def run_deployments(model: str, deps: list[Deployment], args: argparse.Namespace) -> tuple[dict, dict]:
    """Every deployment, ``--concurrent`` at a time, plays ``--rounds`` rounds; (calibration, results by
    label)."""
    size = args.concurrent or len(deps)
    calibration: dict = {}
    results: dict[str, list[dict]] = {}
    for first in range(0, len(deps), size):
        group = deps[first : first + size]
        print(f"deployments up: {', '.join(d.label for d in group)}", file=sys.stderr, flush=True)
        cal, res = _run_group(model, group, first, args)
        calibration = calibration or cal
        results.update(res)
    return calibration, results


def _run_group(
    model: str, deps: list[Deployment], offset: int, args: argparse.Namespace
) -> tuple[dict, dict]:
    """Start ``deps`` at once, play ``--rounds`` rounds over them."""
    warm_phases = [{**ph, "n": 4.0, "rate": 20.0} for ph in args.phases]
    with contextlib.ExitStack() as stack:
        args.etcd_endpoint = stack.enter_context(run_etcd()) if args.store == "etcd" else ""
        for i, dep in enumerate(deps, start=offset):
            dep.port = free_port()
            path = Path(tempfile.mkstemp(prefix="xllm-dynpd-", suffix=".yaml")[1])
            path.write_text(yaml.safe_dump(cluster_config(model, dep, i, args)))
            stack.callback(path.unlink, missing_ok=True)
            cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(path)]
            env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
            stack.enter_context(run_server(cmd, dep.port, env=env, name=f"xllm-{dep.label}"))
        dynamic = [d for d in deps if d.dynamic]
        calibration = wait_profiled(dynamic[0], args.instances) if dynamic else {}
        results: dict[str, list[dict]] = {d.label: [] for d in deps}
        for r in range(args.rounds):
            trace = build_trace(model, args.phases, args.seed + 1000 * r, args.burstiness)
            warm = build_trace(model, warm_phases, args.seed + 1000 * r + 500)
            switch_s = trace[int(args.phases[0]["n"])][0]
            for k in range(len(deps)):
                dep = deps[(k + r) % len(deps)]
                res = run_round(dep, trace, warm, switch_s, args)
                res["phase_switch_s"] = round(switch_s, 2)
                results[dep.label].append(res)
                print(f"round {r} {dep.label}: SLO attainment {res['slo_attainment']:.2f}", file=sys.stderr)
    return calibration, results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    model = resolve_checkpoint(args)
    slo = {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms}
    args.phases = [{**slo, **parse_phase(args.phase_a)}, {**slo, **parse_phase(args.phase_b)}]
    counts = (
        range(1, args.instances) if args.static == "all" else [int(n) for n in args.static.split(",") if n]
    )
    deps = [Deployment(n, False) for n in counts]
    if not args.no_colocated:
        deps.append(Deployment(0, False))
    deps.append(Deployment(args.dynamic_start, True))
    calibration, results = run_deployments(model, deps, args)
    static = [aggregate(d, results[d.label], args) for d in deps if d.num_prefill and not d.dynamic]
    dynamic = aggregate(deps[-1], results[deps[-1].label], args)
    colocated = [aggregate(d, results[d.label], args) for d in deps if not d.num_prefill]
    best = max(static, key=lambda s: s["slo_attainment"], default=None)
    result = {
        "trace": {
            "phases": dict(zip("AB", args.phases)),
            "num_requests": sum(int(ph["n"]) for ph in args.phases),
            "rounds": args.rounds,
            "slo_ms": {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms},  # phases may set their own
            "instances": args.instances,
            "threads_per_instance": 1,
            "emulated": args.emulated,
            "store": args.store,
            "model": model,
            "dynamic_start": f"{args.dynamic_start}P{args.instances - args.dynamic_start}D",
            "min_decode": args.min_decode,
            "flip_cooldown_s": args.flip_cooldown_s,
            "burstiness": args.burstiness,
        },
        "calibration": calibration,
        "static": static,
        "dynamic": dynamic,
        "colocated": colocated[0] if colocated else None,
        "best_static": f"{best['num_prefill']}P{best['num_decode']}D" if best else None,
        "dynamic_vs_best_static": dynamic["slo_attainment"] - best["slo_attainment"] if best else None,
    }
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
