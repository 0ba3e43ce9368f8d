"""Distributions of a request's uncached prompt length ``L``: what the throughput model needs of one is
``P(L > t)`` and the conditional means ``E[L | L > t]`` (``l_long``) and ``E[L | L <= t]``
(``l_short``).

- ``LogNormalLengths``: the paper's workload (log-normal ``mu``, ``sigma`` truncated to ``[lo, hi]``),
  in closed form;
- ``EmpiricalLengths``: measured samples (the scheduler's window of uncached lengths after prefix
  matching).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Split:
    """The requests above a threshold and those at or below it."""

    p: float  # P(L > t): the share that goes to PrfaaS
    l_long: float  # E[L | L > t] (0 when p == 0)
    l_short: float  # E[L | L <= t] (0 when p == 1)


class LengthDistribution(Protocol):
    lo: float
    hi: float

    def split(self, threshold: float) -> Split: ...

    def mean(self) -> float: ...

    def expect(self, f: Callable[[float], float], threshold: float, above: bool) -> float: ...


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class LogNormalLengths:
    mu: float
    sigma: float
    lo: float = 1.0
    hi: float = math.inf

    def __post_init__(self) -> None:
        if self.sigma <= 0 or not 0 < self.lo < self.hi:
            raise ValueError("log-normal lengths need sigma > 0 and 0 < lo < hi")

    def _mass(self, a: float, b: float) -> float:
        z = lambda x: _phi((math.log(x) - self.mu) / self.sigma) if x < math.inf else 1.0  # noqa: E731
        return max(0.0, z(b) - z(a))

    def _moment(self, a: float, b: float) -> float:
        s2 = self.sigma**2
        z = lambda x: _phi((math.log(x) - self.mu - s2) / self.sigma) if x < math.inf else 1.0  # noqa: E731
        return math.exp(self.mu + s2 / 2) * max(0.0, z(b) - z(a))

    def split(self, threshold: float) -> Split:
        t = min(max(threshold, self.lo), self.hi)
        total = self._mass(self.lo, self.hi)
        above, below = self._mass(t, self.hi), self._mass(self.lo, t)
        p = above / total
        l_long = self._moment(t, self.hi) / above if above > 0 else 0.0
        l_short = self._moment(self.lo, t) / below if below > 0 else 0.0
        return Split(p, l_long, l_short)

    def mean(self) -> float:
        return self._moment(self.lo, self.hi) / self._mass(self.lo, self.hi)

    def expect(self, f: Callable[[float], float], threshold: float, above: bool) -> float:
        """``E[f(L) | L > t]`` (``above``) or ``E[f(L) | L <= t]``: Simpson's rule over ``log L``."""
        t = min(max(threshold, self.lo), self.hi)
        a, b = (t, self.hi) if above else (self.lo, t)
        if b <= a:
            return 0.0
        la, lb, n = math.log(a), math.log(min(b, 1e12)), 256
        h = (lb - la) / n
        num = den = 0.0
        for k in range(n + 1):
            u = la + k * h
            w = (1 if k in (0, n) else 4 if k % 2 else 2) * math.exp(
                -((u - self.mu) ** 2) / (2 * self.sigma**2)
            )
            num += w * f(math.exp(u))
            den += w
        return num / den if den else 0.0

    def sample(self, n: int, seed: int = 0) -> list[int]:
        """``n`` lengths drawn from the distribution (inverse CDF over the truncated range)."""
        import random

        rng = random.Random(seed)
        a = _phi((math.log(self.lo) - self.mu) / self.sigma)
        b = _phi((math.log(self.hi) - self.mu) / self.sigma) if self.hi < math.inf else 1.0
        out = []
        for _ in range(n):
            u = a + (b - a) * rng.random()
            out.append(int(round(math.exp(self.mu + self.sigma * _inv_phi(u)))))
        return [min(max(x, int(self.lo)), int(self.hi) if self.hi < math.inf else x) for x in out]


def _inv_phi(u: float) -> float:
    """The standard normal quantile (bisection on ``erf``: exact to 1e-10, fast enough for traces)."""
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _phi(mid) < u:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class EmpiricalLengths:
    samples: tuple[int, ...]
    _sorted: list[int] = field(init=False, repr=False, compare=False)
    _prefix: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.samples or min(self.samples) < 0:
            raise ValueError("empirical lengths need at least one sample, none negative")
        ordered = sorted(self.samples)
        prefix = [0.0]
        for x in ordered:
            prefix.append(prefix[-1] + x)
        object.__setattr__(self, "_sorted", ordered)
        object.__setattr__(self, "_prefix", prefix)

    @property
    def lo(self) -> float:
        return float(self._sorted[0])

    @property
    def hi(self) -> float:
        return float(self._sorted[-1])

    def split(self, threshold: float) -> Split:
        n = len(self._sorted)
        k = bisect.bisect_right(self._sorted, threshold)  # samples <= t
        total = self._prefix[-1]
        below = self._prefix[k]
        return Split(
            (n - k) / n,
            (total - below) / (n - k) if k < n else 0.0,
            below / k if k else 0.0,
        )

    def mean(self) -> float:
        return self._prefix[-1] / len(self._sorted)

    def expect(self, f: Callable[[float], float], threshold: float, above: bool) -> float:
        k = bisect.bisect_right(self._sorted, threshold)
        part = self._sorted[k:] if above else self._sorted[:k]
        return sum(f(x) for x in part) / len(part) if part else 0.0
