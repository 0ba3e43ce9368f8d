"""``service.record_trace``: a served run recorded one JSON line per finished request, and the cluster
simulator replays it (``python -m benchmarks.cluster_sim --replay FILE``) with the recorded latencies
beside its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.xservice.conftest import start_server
from xservice.serving.trace_record import TraceRecord, TraceRecorder, load_trace

ROOT = Path(__file__).resolve().parents[3]
RECORDED_LATENCIES = {"ttft_s", "tpot_s"}  # the fields a line carries beside the lengths
PROFILE = {
    "name": "record-test",
    "base_ms": 5.0,
    "tokens_ms": [[1, 0.0], [512, 10.0]],
    "kv_capacity_tokens": 8192,
}


def test_recorder_appends_whole_lines_and_loads_them_by_arrival(tmp_path) -> None:
    path = tmp_path / "sub" / "trace.jsonl"
    rec = TraceRecorder(path)
    rec.record(TraceRecord(arrival=2.0, prompt_tokens=5, output_tokens=3, ttft_s=0.1, tpot_s=0.01))
    rec.record(TraceRecord(arrival=1.0, prompt_tokens=7, output_tokens=1, ttft_s=0.2))
    rec.close()
    rec.record(TraceRecord(arrival=3.0, prompt_tokens=1, output_tokens=1))  # closed: dropped, no error
    loaded = load_trace(path)
    assert [r.prompt_tokens for r in loaded] == [7, 5] and loaded[0].tpot_s is None
    path.write_text(path.read_text() + '{"arrival": 1}\n')
    with pytest.raises(ValueError, match="trace.jsonl:3"):
        load_trace(path)


def test_a_served_run_is_recorded_and_replayed(model_dir, tmp_path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    trace = tmp_path / "served.jsonl"
    handle = start_server(
        model_dir,
        service={"record_trace": str(trace)},
        engine={"device": {"device": "emulated", "device_profile": str(profile)}},
    )
    try:
        client = openai.OpenAI(base_url=handle.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for i, max_tokens in enumerate((4, 9, 2)):
            client.completions.create(
                model="xllm-tiny", prompt="word " * (10 + 5 * i), max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        stream = client.chat.completions.create(
            model="xllm-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        list(stream)
        with pytest.raises(openai.BadRequestError):  # a rejected request is not recorded
            client.completions.create(model="xllm-tiny", prompt="x", max_tokens=-1)
    finally:
        handle.stop()
    records = load_trace(trace)
    assert [r.output_tokens for r in records] == [4, 9, 2, 6]
    assert [r.prompt_tokens for r in records[:3]] == sorted(r.prompt_tokens for r in records[:3])
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert all(RECORDED_LATENCIES <= set(line) for line in lines)  # every request here has 2+ tokens
    assert records[0].arrival <= records[1].arrival <= records[2].arrival
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster_sim", "--instances", "1", "--modes", "colocated",
         "--replay", str(trace), "--profile", str(profile)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["colocated"]["num_requests"] == 4 and out["colocated"]["num_unfinished"] == 0
    assert set(out["recorded"]["ttft_s"]) == {"p50", "p90", "p99"} and out["trace"].startswith("replay of")
