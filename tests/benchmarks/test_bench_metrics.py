"""Serving metric definitions (vLLM's) and the exact-length random prompts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.serve import parse_slos
from benchmarks.serving.client import is_output_chunk
from benchmarks.serving.dataset import load_tokenizer, random_prompts
from benchmarks.serving.load import LoadShape, arrival_gaps
from benchmarks.serving.metrics import RequestRecord, compute_metrics, percentile


def _rec(ttft: float, e2e: float, out: int, itl: list[float]) -> RequestRecord:
    return RequestRecord(success=True, prompt_len=10, output_tokens=out, ttft_s=ttft, e2e_s=e2e, itl_s=itl)


def test_metrics_follow_vllm_definitions() -> None:
    records = [
        _rec(0.1, 1.1, 11, [0.1] * 10),  # tpot = (1.1 - 0.1) / 10 = 0.1
        _rec(0.2, 0.2, 1, []),  # one output token: no tpot
        RequestRecord(success=False, error="HTTP 500"),
    ]
    m = compute_metrics(records, duration_s=2.0, slos_ms={"ttft": 150.0})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 12
    assert m["output_throughput"] == pytest.approx(6.0)
    assert m["total_token_throughput"] == pytest.approx(16.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["goodput"] == pytest.approx(0.5)  # only the first request meets ttft <= 150 ms
    assert m["errors"] == ["HTTP 500"]


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([], 99) == 0.0


def test_parse_slos_rejects_unknown_keys() -> None:
    assert parse_slos(["ttft:500", "e2e:2000"]) == {"ttft": 500.0, "e2e": 2000.0}
    with pytest.raises(ValueError, match="KEY:MS"):
        parse_slos(["latency:5"])


def test_arrivals_all_at_once_or_gamma() -> None:
    assert list(arrival_gaps(3, LoadShape(), seed=0)) == [0.0, 0.0, 0.0]
    gaps = list(arrival_gaps(2000, LoadShape(request_rate=10.0, burstiness=0.5), seed=0))
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.15)
    assert not any(math.isinf(g) for g in gaps)


def test_random_prompts_have_exact_token_counts(tiny_qwen3: Path) -> None:
    tok = load_tokenizer(str(tiny_qwen3))
    for length in (1, 7, 64):
        for text, n in random_prompts(str(tiny_qwen3), 8, length, seed=3):
            assert n == length
            assert len(tok.encode(text, add_special_tokens=False).ids) == length


def test_output_chunks_skip_role_announcements_and_usage() -> None:
    assert is_output_chunk({"choices": [{"text": ""}]})  # held-back bytes still mark a step
    assert is_output_chunk({"choices": [{"delta": {"content": "hi"}}]})
    assert not is_output_chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not is_output_chunk({"choices": [], "usage": {"completion_tokens": 3}})
