"""Per-request records and the summary metrics, with vLLM benchmark_serving's definitions.

- TTFT: request start → first streamed chunk that carries a choice (text may be empty; a chat
  chunk that only announces the role does not count).
- ITL: gaps between consecutive such chunks of one request.
- TPOT (per request): (E2E − TTFT) / (output_tokens − 1); requests with one output token are left out.
- E2E: request start → last byte of the response.
- Goodput: completed requests per second that meet every given SLO (TTFT, TPOT, E2E, in ms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one request measured. Times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(E2E − TTFT) / (output_tokens − 1), or None for a single-token output."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_ms(values_s: list[float], name: str) -> dict[str, float]:
    """mean / median / p90 / p99 of ``values_s`` (seconds) as ``{name}_ms`` keys in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    out = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0}
    out[f"median_{name}_ms"] = percentile(ms, 50)
    for q in PERCENTILES[1:]:
        out[f"p{q}_{name}_ms"] = percentile(ms, q)
    return out


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO in ``slos_ms`` (keys ttft / tpot / e2e)."""
    measured = {"ttft": rec.ttft_s, "tpot": rec.tpot_s or 0.0, "e2e": rec.e2e_s}
    return all(measured[k] * 1000.0 <= v for k, v in slos_ms.items())


def compute_metrics(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float]) -> dict:
    """Aggregate request records of one run into the summary dict (vLLM's definitions)."""
    done = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    dur = max(duration_s, 1e-9)
    out: dict = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    out.update(summarize_ms([r.ttft_s for r in done], "ttft"))
    out.update(summarize_ms([t for r in done if (t := r.tpot_s) is not None], "tpot"))
    out.update(summarize_ms([g for r in done for g in r.itl_s], "itl"))
    out.update(summarize_ms([r.e2e_s for r in done], "e2e"))
    out["goodput"] = sum(meets_slos(r, slos_ms) for r in done) / dur if slos_ms else None
    errors = sorted({r.error for r in records if not r.success and r.error})
    if errors:
        out["errors"] = errors[:5]
    return out
