"""``xllm profile engine`` measures a model's engine steps here and writes a device profile that loads
(``ops/platforms/device_profile.py``), keeps every probe with its prediction, and drives an emulated
engine; bad flags get one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ops.platforms.device_profile import load_profile
from xengine.llm import LLM

ROOT = Path(__file__).resolve().parents[3]


def _xllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xservice", *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )


def test_profile_engine_writes_a_profile_an_emulated_engine_runs(make_model_dir, tmp_path: Path) -> None:
    model, out = make_model_dir("qwen3"), tmp_path / "profile.json"
    done = _xllm(
        "profile", "engine", "--model", str(model), "--out", str(out), "--repeats", "1", "--max-tokens", "256"
    )
    assert done.returncode == 0, done.stderr
    assert "[profile] decode" in done.stderr and "error median" in done.stderr  # progress as it goes
    profile = load_profile(out)
    samples = profile.measured["samples"]
    assert {s["kind"] for s in samples} == {"decode", "prefill", "context"}
    assert all(s["ms"] > 0 and "predicted_ms" in s for s in samples)
    assert profile.base_ms > 0 and profile.kv_bytes_per_token > 0 and profile.transfer_gbps > 0
    assert profile.measured["num_threads"] == 1 and "cpu" in profile.device
    assert [p[0] for p in profile.tokens_ms] == sorted(
        {s["tokens"] for s in samples if s["kind"] != "context"}
    )
    llm = LLM(str(model), device="emulated", device_profile=str(out), block_size=16)
    assert llm.generate(["hello"], use_tqdm=False)[0].outputs[0].token_ids


def test_bad_flags_are_one_line_errors(make_model_dir, tmp_path: Path) -> None:
    done = _xllm("profile", "engine", "--model", str(tmp_path))
    assert done.returncode == 2 and "no config.json" in done.stderr and "Traceback" not in done.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "base_ms": 1.0, "tokens_ms": []}))
    model = make_model_dir("qwen3")
    done = _xllm(
        "serve", "--model", str(model), "--device", "emulated", "--device-profile", str(bad), "--port", "0"
    )
    assert (
        done.returncode != 0
        and f"tokens_ms must be a non-empty list of [tokens, ms] points ({bad})" in done.stderr
    )
