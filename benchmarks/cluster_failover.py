"""Failover latency: time from ``kill -9`` of an engine to the first token of its migrated requests.

Two instances serve several greedy streams; the instance with the most in-flight requests is
SIGKILLed mid-stream. Measured twice: with the ``InstanceSupervisor``'s process-exit watch (how
``xllm serve`` with the local launcher detects it; the supervisor then relaunches the instance,
which brings the cluster back to two) and with the registry alone (lease expiry / heartbeat gap, the
only signal for a remote or Ray instance). Prints JSON.

    PYTHONPATH=. .venv/bin/python -m benchmarks.cluster_failover [--model DIR] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.cluster_common import LocalCluster
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args
from xengine.api.messages import AddRequest, SamplingParams


async def stream(pool, req_id: str, prompt: list[int], max_tokens: int, log: dict) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = log.setdefault(req_id, [])
    async for delta in pool.generate(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params)):
        now = time.monotonic()
        for _ in delta.new_token_ids:
            tokens.append(now)


async def one_failure(cluster: LocalCluster, mode: str, args: argparse.Namespace) -> dict:
    pool = cluster.pool
    log: dict[str, list[float]] = {}
    prompts = [[10 + (7 * i + j) % 200 for j in range(64)] for i in range(args.streams)]
    tasks = [
        asyncio.create_task(stream(pool, f"{mode}-{i}", p, args.max_tokens, log))
        for i, p in enumerate(prompts)
    ]
    while min((len(log.get(f"{mode}-{i}", ())) for i in range(args.streams)), default=0) < 5:
        await asyncio.sleep(0.01)
    victim = max(pool.clients.values(), key=lambda c: pool._inflight.get(c.name, 0))
    on_victim = [rid for rid, (client, _) in pool._active.items() if client is victim]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.gather(*tasks)
    # Tokens the victim sent before it died may still arrive after the kill: the first migrated token
    # is the first one after the pool declared the victim dead (migration starts there).
    dead_at = pool._dead_at
    first = [min(t for t in log[r] if t >= dead_at) - killed for r in on_victim if log[r][-1] >= dead_at]
    return {
        "detection": mode,
        "victim": victim.name,
        "migrated_requests": len(on_victim),
        "all_completed": all(len(v) == args.max_tokens for v in log.values()),
        "kill_to_detection_ms": round((dead_at - killed) * 1000, 1),
        "kill_to_first_migrated_token_ms": _stats_ms(first),
    }


def _stats_ms(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None  # the victim's streams finished before it died (raise --max-tokens)
    return {
        "min": round(min(xs) * 1000, 1),
        "mean": round(statistics.mean(xs) * 1000, 1),
        "max": round(max(xs) * 1000, 1),
    }


async def run(args: argparse.Namespace) -> dict:
    model = resolve_checkpoint(args)
    results = []
    async with LocalCluster(model, policy="least_load") as cluster:
        await cluster.launch(["engine-0", "engine-1"])
        await cluster.supervise(True)
        result = await one_failure(cluster, "process_exit_watch", args)
        await cluster.pool.wait_for([result["victim"]], 300.0)  # relaunched: back to two instances
        result["relaunched"] = cluster.supervisor.num_restarts[result["victim"]] == 1
        results.append(result)
        await cluster.supervise(False)
        results.append(await one_failure(cluster, "registry_lease_or_heartbeat", args))
        cl = cluster.cfg.cluster
    return {
        "benchmark": "cluster_failover",
        "model": model,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "lease_ttl_s": cl.registry.lease_ttl_s,
        "heartbeat_interval_s": cl.registry.heartbeat_interval_s,
        "results": results,
        "machine": describe(cluster.engine.device.num_threads),
    }


SMOKE = {"streams": 2, "max_tokens": 400}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_args(p)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=200)
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(asyncio.run(run(parse_args(build_parser(), argv, SMOKE))), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
