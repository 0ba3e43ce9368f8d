"""The arrival process and the run loop: gamma-distributed arrivals, optional concurrency cap."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp

from benchmarks.serving.client import RequestSpec, send_request
from benchmarks.serving.metrics import RequestRecord


@dataclass(frozen=True)
class LoadShape:
    """``request_rate`` req/s (inf: all at once); ``burstiness`` is the gamma shape (1 = Poisson);
    ``max_concurrency`` caps requests in flight (None: no cap)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None


def arrival_gaps(n: int, shape: LoadShape, seed: int) -> Iterator[float]:
    """Seconds to wait before each of ``n`` requests: gamma(k=burstiness, mean=1/rate), or 0."""
    rng = random.Random(seed)
    for _ in range(n):
        if math.isinf(shape.request_rate):
            yield 0.0
        else:
            theta = 1.0 / (shape.request_rate * shape.burstiness)
            yield rng.gammavariate(shape.burstiness, theta)


async def run_load(
    specs: list[RequestSpec], shape: LoadShape, seed: int
) -> tuple[list[RequestRecord], float]:
    """Send every request under ``shape``; return the records (in spec order) and the wall duration."""
    limit = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    done = 0

    async def one(spec: RequestSpec) -> RequestRecord:
        nonlocal done
        if limit is None:
            rec = await send_request(session, spec)
        else:
            async with limit:
                rec = await send_request(session, spec)
        done += 1
        print(f"\r{done}/{len(specs)} requests done", end="", file=sys.stderr, flush=True)
        return rec

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for spec, gap in zip(specs, arrival_gaps(len(specs), shape, seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(spec)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    print(file=sys.stderr)
    return list(records), duration
