"""Request traces for the cluster simulator: arrival processes and length distributions.

- ``steady``: Poisson arrivals at ``rate``; log-normal prompt and output lengths.
- ``bursty``: gamma inter-arrival times with coefficient of variation ``burstiness`` (4: bursts of many
  requests, then lulls) at the same mean rate.
- ``shifting``: Poisson arrivals; the first half prefill-heavy (long prompts, short outputs), the second
  decode-heavy (short prompts, long outputs) -- the mix dynamic PD should follow.

Shared prefixes (``PrefixMix``): each request belongs to one of ``groups`` groups (Zipf popularity: a few
system prompts or documents most requests share, a long tail) and its prompt is the group's ``tokens``
of shared prefix followed by its own log-normal part -- what prefix caching and cache-aware placement
feed on. ``offline_share`` marks that share of the requests offline (batch jobs: no latency SLO,
co-located around the online ones where the cluster does so).
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
    group: int = -1  # shared-prefix group (-1: none)
    prefix: int = 0  # leading prompt tokens it shares with its group
    offline: bool = False  # a batch job's request: no latency SLO, served around the online ones


@dataclass(frozen=True)
class PrefixMix:
    groups: int  # distinct shared prefixes
    tokens: int  # each one's length
    zipf: float = 1.0  # popularity exponent: group k is picked with weight (k + 1) ** -zipf

    def __post_init__(self) -> None:
        if self.groups < 1 or self.tokens < 1:
            raise ValueError("a prefix mix needs groups >= 1 and tokens >= 1")


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
    prefix: PrefixMix | None = None,
    offline_share: float = 0.0,
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
    groups, shared = np.full(num_requests, -1), 0
    if prefix is not None:
        weights = np.arange(1, prefix.groups + 1, dtype=float) ** -prefix.zipf
        groups = rng.choice(prefix.groups, size=num_requests, p=weights / weights.sum())
        shared = min(prefix.tokens, max_len // 2)
    offline = rng.random(num_requests) < offline_share if offline_share > 0 else np.zeros(num_requests, bool)
    return [
        SimRequest(i, float(a), shared + int(p), int(o), int(g), shared if g >= 0 else 0, bool(off))
        for i, (a, p, o, g, off) in enumerate(zip(arrivals, prompts, outputs, groups, offline))
    ]
