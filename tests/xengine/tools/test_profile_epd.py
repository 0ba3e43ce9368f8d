"""``xllm profile epd`` on a tiny Qwen2-VL checkpoint: real engine steps timed, budgets found by binary
search over them, every strategy and split ranked; bad flags are one-line errors. Timings are quoted,
never asserted on (the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xengine.tools.profile_epd import StageBench
from xservice.engine.process import child_env

QUICK = [
    "--threads",
    "2",
    "--repeats",
    "1",
    "--max-batch",
    "4",
    "--max-images",
    "4",
    "--max-encode-images",
    "8",
]
QUICK += ["--max-prefill-tokens", "512"]


@pytest.fixture(scope="module")
def vl_model(make_model_dir) -> Path:
    return make_model_dir("qwen2_vl")


def xllm(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "xservice", "profile", "epd", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=240)


def test_stage_bench_times_real_steps_of_decodes_with_encodes_and_prefill_chunks(vl_model: Path) -> None:
    bench = StageBench(str(vl_model), (224, 224), num_threads=2)
    assert bench.encode_mode == "engine"  # the engine's encode stage runs encode-only requests
    info = bench.info()
    assert (info["image_tokens_per_image"], info["patches_per_image"]) == (64, 256)  # 224x224: 16x16 patches
    encodes = bench.engine.get_stats().num_image_encodes
    assert bench.step_encode(3, 40, 2, repeats=1) > 0  # the step is checked to encode exactly 2 images
    assert bench.engine.get_stats().num_image_encodes - encodes == 4  # warm-up + one repeat, 2 each
    assert bench._running_decodes() == 3  # the decodes ran on through the probes
    assert bench.step_prefill(3, 40, 100, repeats=1) > 0  # checked: 4 sequences, 100 prefill tokens
    assert bench._running_decodes() == 3
    assert bench.prefill(64, repeats=1) > 0 and bench._running_decodes() == 0
    bench.clear()
    assert not bench.engine.has_unfinished_requests()


def test_profile_json_report_on_the_image_heavy_workload(vl_model: Path) -> None:
    r = xllm("--model", str(vl_model), "--workload", "image-heavy", "--ttft-slo-ms", "300", "--tpot-slo-ms", "25",
             "--instances", "4", *QUICK, "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["machine"]["num_threads"] == 2 and doc["machine"]["encode_mode"] == "engine"
    w = doc["workload"]
    assert (w["images_per_request"], w["image_tokens_per_image"], w["prompt_len"]) == (4, 64, 32 + 4 * 64)
    assert [s["images"] for s in doc["samples"]["encode"]] == [1, 2, 4]
    decode = doc["samples"]["decode"]
    assert [d["batch"] for d in decode[:4]] == [1, 1, 4, 4]  # batches 1, 4 x two contexts
    assert all(d["batch"] > 4 for d in decode[4:]) and len(decode) <= 5  # the chosen operating point
    for stage in ("encode", "prefill", "decode"):
        assert all(c >= 0 for c in doc["costs"][stage]["coef"])
    # 1 EPD + 3 EP+D + 3 ED+P + 3 E+P+D splits, each summing to 4, best first
    rows = doc["strategies"]
    assert len(rows) == 10 and doc["choice"] == rows[0]
    assert all(sum(row["counts"].values()) == 4 and min(row["counts"].values()) >= 1 for row in rows)
    assert [row["goodput"] for row in rows] == sorted((row["goodput"] for row in rows), reverse=True)
    assert all(row["limit"] for row in rows)
    # the budgets are the binary search's answer over the measured steps it probed
    b = doc["budgets"]
    measured, slo = b["measured"], doc["slo"]["tpot_ms"] / 1e3
    _check_search(measured, "encode", measured["tau_e"], 1, slo)
    chunk = measured["tau_t"] - b["decode_batch"] if measured["tau_t"] else -1
    _check_search(measured, "prefill", chunk, b["token_granularity"], slo)
    config = measured["config"]
    assert config["scheduler.max_encode_images"] == max(1, measured["tau_e"])
    assert config["scheduler.max_encode_tokens"] == config["scheduler.max_encode_images"] * 64
    assert config["scheduler.max_num_batched_tokens"] == max(1, measured["tau_t"])
    print("measured:", json.dumps({k: doc[k] for k in ("costs", "budgets", "choice")})[:3000])


def _check_search(budget: dict, kind: str, answer: int, step: int, slo: float) -> None:
    probes = {p["x"]: p["s"] for p in budget["probes"] if p["kind"] == kind}
    if answer < 0 or kind == "encode" and not probes:
        return  # the decodes alone were over the SLO: nothing else probed
    assert probes[answer] <= slo  # the answer was measured under the SLO ...
    above = [x for x in probes if x > answer]
    if above:  # ... and the next point up was measured over it
        assert answer + step in probes and probes[answer + step] > slo


def test_profile_table_on_a_custom_text_heavy_workload(vl_model: Path) -> None:
    r = xllm("--model", str(vl_model), "--images-per-request", "1", "--image-size", "112x112", "--prompt-tokens", "200",
             "--output-tokens", "64", "--request-rate", "5", "--ttft-slo-ms", "500", "--tpot-slo-ms", "40",
             "--instances", "3", "--cores", "2", *QUICK)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in ("fitted stage costs", "Algorithm 1 budgets", "scheduler.max_encode_images", "scheduler.max_num_batched_tokens",
                 "E+P+D", "EP+D", "ED+P", "EPD", "choice:", "rate 5 req/s", "2 threads", "share 2 cores"):  # fmt: skip
        assert text in out, text
    print(out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "image-heavy", "--image-size", "10x10"], "give one or the other"),
        (["--images-per-request", "2"], "--image-size, --prompt-tokens, --output-tokens"),
        (["--images-per-request", "1", "--image-size", "big", "--prompt-tokens", "5", "--output-tokens", "5"], "--image-size must be WxH"),
        (["--workload", "text-heavy", "--request-rate", "-3"], "--request-rate must be"),
        (["--workload", "text-heavy", "--instances", "0"], "--instances must be >= 1"),
        (["--workload", "text-heavy", "--cores", "0"], "--cores must be > 0"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line_errors(vl_model: Path, args: list[str], message: str) -> None:
    base = ["--model", str(vl_model), "--ttft-slo-ms", "100", "--tpot-slo-ms", "10", "--instances", "3"]
    r = xllm(*base, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_or_text_only_model_is_a_clear_error(tmp_path: Path, make_model_dir) -> None:
    base = ["--workload", "image-heavy", "--ttft-slo-ms", "100", "--tpot-slo-ms", "10", "--instances", "3"]
    r = xllm("--model", str(tmp_path), *base)
    assert r.returncode == 2 and "no config.json" in r.stderr
    r = xllm("--model", str(make_model_dir("qwen3")), *base)
    assert r.returncode == 2 and "not a vision-language model" in r.stderr and "Traceback" not in r.stderr


def test_the_budget_search_batch_fits_the_probe_engine() -> None:
    """A chosen deployment may decode in batches larger than the probe engine holds beside one more
    request: the budgets are searched at the largest batch it does hold."""
    from xservice.cluster.epd.profiler import probe_capacity

    assert probe_capacity({"max_num_seqs": 256}, 52) == 255
    assert probe_capacity({"max_num_seqs": 256, "kv_cache_tokens": 16 * 116}, 52) == 15
    assert probe_capacity({"max_num_seqs": 256, "kv_cache_tokens": 10}, 52) == 1
