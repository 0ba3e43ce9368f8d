"""Failover latency: time from ``kill -9`` of an engine to the first token of its migrated requests.

Two instances serve several greedy streams; the instance with the most in-flight requests is
SIGKILLed mid-stream. Measured twice: with the launcher's process-exit watch (how ``xllm serve``
with the local launcher detects it) and with the registry alone (lease expiry / heartbeat gap, the
only signal for a remote or Ray instance). Prints JSON.

    python benchmarks/cluster_failover.py [--model DIR] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time

from cluster_common import LocalCluster, ensure_model

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
    counts = {k: len(v) for k, v in log.items()}
    on_victim = [rid for rid, (client, _) in pool._active.items() if client is victim]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.gather(*tasks)
    first = [log[r][counts[r]] - killed for r in on_victim if len(log[r]) > counts[r]]
    return {
        "detection": mode,
        "victim": victim.name,
        "migrated_requests": len(on_victim),
        "all_completed": all(len(v) == args.max_tokens for v in log.values()),
        "kill_to_first_migrated_token_ms": {
            "min": round(min(first) * 1000, 1),
            "mean": round(statistics.mean(first) * 1000, 1),
            "max": round(max(first) * 1000, 1),
        },
    }


async def main(args: argparse.Namespace) -> dict:
    model = ensure_model(args.model, args.size)
    results = []
    async with LocalCluster(model, policy="least_load") as cluster:
        await cluster.launch(["engine-0", "engine-1"])
        cluster.watch_exits(True)
        results.append(await one_failure(cluster, "process_exit_watch", args))
        cluster.watch_exits(False)
        await cluster.launch(["engine-2"])  # back to two instances
        results.append(await one_failure(cluster, "registry_lease_or_heartbeat", args))
    return {
        "benchmark": "cluster_failover",
        "model": model,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "lease_ttl_s": 3.0,
        "heartbeat_interval_s": 0.5,
        "results": results,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: a generated tiny qwen3)")
    p.add_argument("--size", default="tiny", choices=("tiny", "small"))
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=200)
    print(json.dumps(asyncio.run(main(p.parse_args())), indent=2))
