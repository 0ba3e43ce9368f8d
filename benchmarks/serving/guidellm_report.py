"""The numbers of a guidellm JSON report, per concurrency level, and xllm-vs-peer ratios (pure).

guidellm's report has ``benchmarks[i]``, one per level of its ``concurrent`` profile, with the level in
``config.strategy.streams`` and the metrics in ``metrics[name][section]`` (``successful`` or ``total``:
mean, median, ``percentiles.p50/p95/...``). Throughput is ``output_tokens_per_second.total.mean``,
what guidellm's own "Server Throughput" table prints; latencies are those of the completed requests.
"""

from __future__ import annotations

from typing import Any

LATENCIES = {"ttft_ms": "time_to_first_token_ms", "itl_ms": "inter_token_latency_ms"}


def _stat(metrics: dict[str, Any], name: str, section: str, key: str) -> float | None:
    part = metrics.get(name, {}).get(section, {})
    value = part.get(key) if key in ("mean", "median", "count") else part.get("percentiles", {}).get(key)
    return None if value is None else float(value)


def level_summary(bench: dict[str, Any]) -> dict[str, Any]:
    """One level's numbers: output tok/s, TTFT / ITL p50 and p95, TPOT p50, requests by outcome."""
    m = bench["metrics"]
    out: dict[str, Any] = {"output_tok_s": _stat(m, "output_tokens_per_second", "total", "mean")}
    for short, name in LATENCIES.items():
        out[short] = {p: _stat(m, name, "successful", p) for p in ("p50", "p95")}
    out["tpot_ms"] = {"p50": _stat(m, "time_per_output_token_ms", "successful", "p50")}
    totals = m.get("request_totals", {})
    out["requests"] = {k: int(totals.get(k, 0)) for k in ("successful", "errored", "incomplete")}
    out["prompt_tokens_mean"] = _stat(m, "prompt_token_count", "successful", "mean")
    out["output_tokens_mean"] = _stat(m, "output_token_count", "successful", "mean")
    out["duration_s"] = bench.get("duration")
    return out


def summarize(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{concurrency: level_summary}`` of a guidellm report, keys as strings in ascending order."""
    levels = {int(b["config"]["strategy"]["streams"]): level_summary(b) for b in report["benchmarks"]}
    return {str(c): levels[c] for c in sorted(levels)}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def ratios(ours: dict[str, dict[str, Any]], peer: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per concurrency level both sides have: tok/s ours / peer, and latencies peer / ours, so every
    ratio above 1 means we are better."""
    out = {}
    for c in ours.keys() & peer.keys():
        a, b = ours[c], peer[c]
        row = {"output_tok_s_xllm_over_vllm": _ratio(a["output_tok_s"], b["output_tok_s"])}
        for short in LATENCIES:
            for p in ("p50", "p95"):
                row[f"{short.removesuffix('_ms')}_{p}_vllm_over_xllm"] = _ratio(b[short][p], a[short][p])
        row["tpot_p50_vllm_over_xllm"] = _ratio(b["tpot_ms"]["p50"], a["tpot_ms"]["p50"])
        out[c] = row
    return {c: out[c] for c in sorted(out, key=int)}


def guidellm_version(report: dict[str, Any]) -> str | None:
    """The guidellm version that wrote ``report``."""
    return report.get("metadata", {}).get("guidellm_version")
