"""Request traces for the cluster simulator: arrival processes and length distributions.

- ``steady``: Poisson arrivals at ``rate``; log-normal prompt and output lengths.
- ``bursty``: gamma inter-arrival times with coefficient of variation ``burstiness`` (4: bursts of many
  requests, then lulls) at the same mean rate.
- ``shifting``: Poisson arrivals; the first half prefill-heavy (long prompts, short outputs), the second
  decode-heavy (short prompts, long outputs) -- the mix dynamic PD should follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TRACES = ("steady", "bursty", "shifting")


@dataclass(frozen=True)
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int


@dataclass(frozen=True)
class LengthMix:
    prompt_median: float
    output_median: float
    sigma: float = 0.6  # of log lengths


def _lengths(rng: np.random.Generator, n: int, median: float, sigma: float, cap: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), 2, cap).astype(int)


def make_trace(
    kind: str,
    num_requests: int,
    rate: float,
    seed: int = 0,
    mix: LengthMix = LengthMix(1024, 256),
    max_len: int = 16384,
    burstiness: float = 4.0,
) -> list[SimRequest]:
    if kind not in TRACES:
        raise ValueError(f"unknown trace {kind!r}; choose one of {', '.join(TRACES)}")
    if num_requests < 1 or rate <= 0:
        raise ValueError("num_requests must be >= 1 and rate > 0")
    rng = np.random.default_rng(seed)
    if kind == "bursty":
        shape = 1.0 / burstiness**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), num_requests)
    else:
        gaps = rng.exponential(1.0 / rate, num_requests)
    arrivals = np.cumsum(gaps)
    if kind == "shifting":
        half = num_requests // 2
        heavy = LengthMix(mix.prompt_median * 2, max(4, mix.output_median / 4), mix.sigma)
        light = LengthMix(max(16, mix.prompt_median / 4), mix.output_median * 2, mix.sigma)
        prompts = np.concatenate([
            _lengths(rng, half, heavy.prompt_median, mix.sigma, max_len // 2),
            _lengths(rng, num_requests - half, light.prompt_median, mix.sigma, max_len // 2),
        ])  # fmt: skip
        outputs = np.concatenate([
            _lengths(rng, half, heavy.output_median, mix.sigma, max_len // 2),
            _lengths(rng, num_requests - half, light.output_median, mix.sigma, max_len // 2),
        ])  # fmt: skip
    else:
        prompts = _lengths(rng, num_requests, mix.prompt_median, mix.sigma, max_len // 2)
        outputs = _lengths(rng, num_requests, mix.output_median, mix.sigma, max_len // 2)
    return [
        SimRequest(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))
    ]
