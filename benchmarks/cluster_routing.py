"""Cache-aware vs round-robin routing over two instances on a multi-turn shared-prefix workload.

Each conversation has its own long system prompt; every turn resends the whole history plus a new
question (like a chat client). Turns of all conversations are sent concurrently (in a shuffled order), round by round.
Both policies run against the same two engines (prefix caches reset in between). Prints JSON:
prefix hit rate (cached prompt tokens / prompt tokens) and TTFT per policy.

    PYTHONPATH=. .venv/bin/python -m benchmarks.cluster_routing [--model DIR] [--conversations 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.cluster_common import LocalCluster
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args
from xengine.api.messages import AddRequest, SamplingParams
from xservice.policies import make_policy


async def one_request(pool, req_id: str, prompt: list[int], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params)
    start, ttft, out, cached = time.perf_counter(), None, [], 0
    async for delta in pool.generate(req):
        if ttft is None and delta.new_token_ids:
            ttft = time.perf_counter() - start
            cached = delta.num_cached_tokens
        out.extend(delta.new_token_ids)
    return {"ttft_s": ttft, "cached": cached, "prompt": len(prompt), "output": out}


async def run_policy(cluster: LocalCluster, policy: str, args: argparse.Namespace) -> dict:
    await cluster.pool.reset_prefix_cache()
    await asyncio.sleep(1.5)  # let the KV removal events reach the global index
    cluster.pool.policy = make_policy(policy)
    rng = random.Random(args.seed)
    vocab = cluster.pool.info.vocab_size
    histories = [
        [rng.randrange(10, vocab) for _ in range(args.system_tokens)] for _ in range(args.conversations)
    ]
    results = []
    for turn in range(args.turns):
        for h in histories:
            h.extend(rng.randrange(10, vocab) for _ in range(args.question_tokens))
        order = list(range(args.conversations))
        rng.shuffle(order)  # conversations come back in any order (same order for every policy)
        batch = [
            one_request(cluster.pool, f"{policy}-c{c}-t{turn}", list(histories[c]), args.max_tokens)
            for c in order
        ]
        outs = await asyncio.gather(*batch)
        for c, o in zip(order, outs):
            histories[c].extend(o["output"])
        results.extend(o | {"turn": turn} for o in outs)
        await asyncio.sleep(args.think_time_s)
    later = [r for r in results if r["turn"] > 0]
    ttfts = [r["ttft_s"] for r in results]
    return {
        "policy": policy,
        "num_requests": len(results),
        "prefix_hit_rate": round(sum(r["cached"] for r in results) / sum(r["prompt"] for r in results), 4),
        "prefix_hit_rate_follow_up_turns": round(
            sum(r["cached"] for r in later) / sum(r["prompt"] for r in later), 4
        ),
        "mean_ttft_ms": round(statistics.mean(ttfts) * 1000, 2),
        "p90_ttft_ms": round(sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] * 1000, 2),
        "routed": dict(cluster.pool.num_routed),
    }


async def run(args: argparse.Namespace) -> dict:
    model = resolve_checkpoint(args)
    async with LocalCluster(model) as cluster:
        await cluster.launch(["engine-0", "engine-1"])
        runs = []
        for policy in ("round_robin", "cache_aware"):
            before = dict(cluster.pool.num_routed)
            run = await run_policy(cluster, policy, args)
            run["routed"] = {n: c - before.get(n, 0) for n, c in cluster.pool.num_routed.items()}
            runs.append(run)
    return {
        "benchmark": "cluster_routing",
        "model": model,
        "instances": 2,
        "conversations": args.conversations,
        "turns": args.turns,
        "system_tokens": args.system_tokens,
        "question_tokens": args.question_tokens,
        "max_tokens": args.max_tokens,
        "results": runs,
        "machine": describe(cluster.engine.device.num_threads),
    }


SMOKE = dict(conversations=2, turns=2, system_tokens=32, question_tokens=8, max_tokens=2, think_time_s=0.1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_checkpoint_args(p)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think-time-s", type=float, default=0.7, help="pause between rounds (>= one heartbeat)")
    p.add_argument("--seed", type=int, default=0)
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(asyncio.run(run(parse_args(build_parser(), argv, SMOKE))), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
