"""What the throughput model knows of a cluster's instances, from a profile (plain JSON data):

- ``PrefillCurve``: an instance's prefill latency ``T_prefill(l)`` and KV size ``S_kv(l)`` by uncached
  prompt length, interpolated log-log between measured rows (power laws between them; the end segments
  extended) -- the paper's Table 5 is four such rows;
- ``DecodeRate``: a decode instance's largest batch ``BS_max`` whose step ``T_decode`` meets the TPOT SLO.

Two profile shapes are read. A **stage table** (published rows, or rows measured per request)::

    {"name": "...", "prefill": {"tokens": [1024, ...], "seconds": [0.44, ...], "kv_mib": [190.8, ...]},
     "decode": {"max_batch": 20, "step_s": 0.025}}

(``kv_bytes`` instead of ``kv_mib`` too), or a **device profile** (``ops/platforms/device_profile.py``,
what ``xllm profile engine`` writes and emulated instances run): a prompt of ``l`` tokens prefills in
steps of at most ``chunk`` tokens priced by its step-time model, its KV is ``kv_bytes_per_token * l``, and
a decode batch of ``b`` at context ``c`` steps in ``base + tokens(b) + seq * b + attention * b * c``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


def _interp(xs: Sequence[float], ys: Sequence[float], x: float, loglog: bool = True) -> float:
    """``ys`` at ``x`` between the points ``xs`` (increasing), along the end segments outside them:
    power laws between points (``loglog``; linear where a value is 0), or straight lines."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = next((k for k in range(1, len(xs) - 1) if x <= xs[k]), len(xs) - 1)
    x0, y0, x1, y1 = xs[i - 1], ys[i - 1], xs[i], ys[i]
    if not loglog or y0 <= 0 or y1 <= 0:
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return y0 * math.exp(math.log(y1 / y0) / math.log(x1 / x0) * math.log(max(x, 1.0) / x0))


@dataclass(frozen=True)
class PrefillCurve:
    name: str
    tokens: tuple[float, ...]  # increasing prompt lengths
    seconds: tuple[float, ...]  # one instance's prefill latency at each
    kv_bytes: tuple[float, ...]  # the KV (and state) a prompt of that length leaves to ship

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0 or len(self.seconds) != n or len(self.kv_bytes) != n:
            raise ValueError(
                f"prefill curve {self.name!r}: tokens, seconds and kv sizes need one value per row"
            )
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or self.tokens[0] <= 0:
            raise ValueError(f"prefill curve {self.name!r}: token counts must be positive and increasing")
        if any(not math.isfinite(v) or v < 0 for v in self.kv_bytes):
            raise ValueError(f"prefill curve {self.name!r}: KV sizes must be finite and >= 0")
        if any(not math.isfinite(v) or v <= 0 for v in self.seconds):
            raise ValueError(f"prefill curve {self.name!r}: latencies must be finite and > 0")

    def prefill_s(self, tokens: float) -> float:
        return _interp(self.tokens, self.seconds, tokens)

    def kv_size(self, tokens: float) -> float:
        return _interp(self.tokens, self.kv_bytes, tokens)

    def kv_throughput_gbps(self, tokens: float) -> float:
        """Equation 1: ``Phi_kv(l) = S_kv(l) / T_prefill(l)`` in Gbit/s."""
        return self.kv_size(tokens) * 8 / self.prefill_s(tokens) / 1e9


@dataclass(frozen=True)
class DecodeRate:
    max_batch: int  # BS_max: the largest batch whose step meets the SLO
    step_s: float  # T_decode at that batch

    def __post_init__(self) -> None:
        if self.max_batch < 1 or not self.step_s > 0:
            raise ValueError("a decode rate needs max_batch >= 1 and step_s > 0")

    def requests_per_s(self, instances: int, output_tokens: float) -> float:
        """Equation 5: ``N_d * BS_max / (T_decode * L_out)``."""
        return instances * self.max_batch / (self.step_s * output_tokens)


# ---------------------------------------------------------------------- reading profiles
def _tokens_cost_ms(points: Sequence[Sequence[float]], tokens: float) -> float:
    """A device profile's piecewise-linear ``tokens_ms`` at ``tokens``."""
    return _interp([float(p[0]) for p in points], [float(p[1]) for p in points], tokens, loglog=False)


def _is_device_profile(data: Mapping[str, Any]) -> bool:
    return "base_ms" in data and "tokens_ms" in data


def _device_prefill_s(data: Mapping[str, Any], tokens: int, chunk: int) -> float:
    total, done = 0.0, 0
    while done < tokens:
        q = min(chunk, tokens - done)
        ms = (
            float(data["base_ms"])
            + _tokens_cost_ms(data["tokens_ms"], q)
            + float(data.get("seq_us", 0)) / 1000
        )
        total += ms / 1000 + float(data.get("attention_ns", 0)) * q * done * 1e-9
        done += q
    return total


def prefill_curve(data: Mapping[str, Any], *, chunk: int | None = None, speedup: float = 1.0) -> PrefillCurve:
    """The prefill curve of a profile (either shape); ``speedup`` divides its latencies (an accelerator
    that many times faster running the same model). ``ValueError`` names what is missing."""
    name = str(data.get("name", "profile"))
    if not speedup > 0:
        raise ValueError("speedup must be > 0")
    if chunk is not None and chunk < 1:
        raise ValueError("the prefill chunk must be >= 1 token")
    if _is_device_profile(data):
        step = chunk or 1 << 30
        lengths = [2**k for k in range(4, 18)]  # 16 .. 128K
        secs = [_device_prefill_s(data, n, step) / speedup for n in lengths]
        kv = [float(data.get("kv_bytes_per_token", 0)) * n for n in lengths]
        return PrefillCurve(name, tuple(map(float, lengths)), tuple(secs), tuple(kv))
    table = data.get("prefill")
    if not isinstance(table, Mapping) or "tokens" not in table or "seconds" not in table:
        raise ValueError(
            f"profile {name!r}: no prefill rows; give 'prefill': {{'tokens': [...], 'seconds': [...], "
            "'kv_mib': [...]}} or a device profile (base_ms, tokens_ms, ...)"
        )
    if "kv_bytes" in table:
        kv = [float(v) for v in table["kv_bytes"]]
    elif "kv_mib" in table:
        kv = [float(v) * MIB for v in table["kv_mib"]]
    else:
        raise ValueError(f"profile {name!r}: prefill rows need 'kv_mib' or 'kv_bytes'")
    secs = [float(v) / speedup for v in table["seconds"]]
    return PrefillCurve(name, tuple(float(v) for v in table["tokens"]), tuple(secs), tuple(kv))


def decode_rate(
    data: Mapping[str, Any], *, slo_tokens_per_s: float, context_tokens: float, max_batch: int = 1024
) -> DecodeRate:
    """A decode instance's ``BS_max`` and ``T_decode`` under a ``slo_tokens_per_s`` stream rate: a stage
    table's ``decode`` row, or the largest batch a device profile steps within ``1 / slo`` at a mean
    context of ``context_tokens`` (and within its KV pool)."""
    name = str(data.get("name", "profile"))
    budget = 1.0 / slo_tokens_per_s
    if _is_device_profile(data):
        capacity = int(data.get("kv_capacity_tokens", 65536))

        def step(b: int) -> float:
            ms = (
                float(data["base_ms"])
                + _tokens_cost_ms(data["tokens_ms"], b)
                + float(data.get("seq_us", 0)) * b / 1000
            )
            return ms / 1000 + float(data.get("attention_ns", 0)) * b * context_tokens * 1e-9

        best = 0
        for b in range(1, max_batch + 1):
            if step(b) > budget or b * context_tokens > capacity:
                break
            best = b
        if not best:
            raise ValueError(
                f"profile {name!r}: one decode step takes {step(1) * 1000:.1f} ms, over the SLO's "
                f"{budget * 1000:.1f} ms (or one context does not fit its KV pool); lower the SLO"
            )
        return DecodeRate(best, step(best))
    row = data.get("decode")
    if not isinstance(row, Mapping) or "max_batch" not in row or "step_s" not in row:
        raise ValueError(f"profile {name!r}: no decode row; give 'decode': {{'max_batch': B, 'step_s': T}}")
    rate = DecodeRate(int(row["max_batch"]), float(row["step_s"]))
    if rate.step_s > budget * (1 + 1e-9):
        raise ValueError(
            f"profile {name!r}: its decode step ({rate.step_s * 1000:.1f} ms) misses the SLO of "
            f"{slo_tokens_per_s:g} tokens/s ({budget * 1000:.1f} ms a step)"
        )
    return rate
