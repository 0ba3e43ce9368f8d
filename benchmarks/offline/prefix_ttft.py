"""TTFT of a prompt sharing most of its tokens with one run just before, prefix caching on vs off.

Each trial runs prompt A (``max_tokens=1``), then times ``generate`` of prompt B (``max_tokens=1``),
which shares ``shared_frac`` of its ``length`` tokens with A. Single requests; median over trials.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.offline.prompts import shared_prefix_pair
from benchmarks.offline.xllm_throughput import greedy


def prefix_ttft(
    llm: Any, pool: list[int], length: int, shared_frac: float, num_trials: int, seed: int
) -> dict:
    """Median / min TTFT in ms of prompt B and the tokens the engine reported as cached."""
    one = greedy(1)
    warm, _ = shared_prefix_pair(pool, length, shared_frac, seed - 1)
    llm.generate([warm], one, use_tqdm=False)
    ttfts, cached = [], []
    for trial in range(num_trials):
        first, second = shared_prefix_pair(pool, length, shared_frac, seed + trial)
        llm.generate([first], one, use_tqdm=False)
        start = time.perf_counter()
        out = llm.generate([second], one, use_tqdm=False)
        ttfts.append(time.perf_counter() - start)
        cached.append(out[0].num_cached_tokens)
    return {
        "median_ttft_ms": statistics.median(ttfts) * 1e3,
        "min_ttft_ms": min(ttfts) * 1e3,
        "num_cached_tokens": statistics.median(cached),
        "num_trials": num_trials,
    }
