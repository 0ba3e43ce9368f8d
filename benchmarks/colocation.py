"""Online/offline co-location on real processes: online TTFT with and without a saturating batch
job, the job's throughput with and without online load, and how long an online arrival waits for
offline work (layer-level vs step-level preemption), measured side by side in one run.

Each configuration is a fresh ``xllm serve`` (engines 1 thread each, ``--threads`` states it):

- ``colocation``: the xLLM §3.1 design, ``cluster.colocation.enabled: true`` over one prefill instance
  (latency-relaxed pool) and one decode instance (latency-strict pool) with Mooncake KV transfer;
  online arrivals stop offline prefill between layers (``scheduler.offline_preemption: layer``);
- ``step_level``: the same cluster with ``offline_preemption: step`` (an online arrival waits for
  the offline step to end);
- ``single_engine`` (``--baselines``): one engine, priority scheduling only (no co-location).

Three phases per configuration: (A) online load alone, (B) a batch job alone, (C) the same online
load while an identical batch job runs. Batch lines run as ``offline`` requests. Job throughput is
counted from sampled progress: in (B) until it completes, in (C) while the online load runs.

    PYTHONPATH=. .venv/bin/python -m benchmarks.colocation --size small

prints ``{"online_ttft_p99_ratio": x, "offline_throughput_ratio": y, "preemption_latency_ms": {...},
"configs": {...}}`` (the two ratios of the ``colocation`` configuration at the top level;
``docs/colocation.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.serve import ServeConfig, run_serving_benchmark
from benchmarks.server_process import free_port, run_server
from benchmarks.serving.dataset import random_prompts
from benchmarks.serving.load import LoadShape
from benchmarks.smoke import add_smoke_flag, parse_args
from benchmarks.xllm_server import REPO_ROOT

_KEEP = ("completed", "failed", "duration_s", "request_throughput", "output_throughput")
MODEL_NAME = "xllm-bench"


def batch_file(model: str, tokenizer: str, num_lines: int, input_len: int, output_len: int) -> bytes:
    prompts = random_prompts(tokenizer, num_lines, input_len, seed=1)
    lines = []
    for i, (text, _) in enumerate(prompts):
        body = {
            "model": model,
            "prompt": text,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines.append(
            json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


def submit_batch(http: httpx.Client, content: bytes) -> str:
    up = http.post(
        "/files", files={"file": ("jobs.jsonl", content, "application/jsonl")}, data={"purpose": "batch"}
    )
    up.raise_for_status()
    body = {"input_file_id": up.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    resp = http.post("/batches", json=body)
    resp.raise_for_status()
    return resp.json()["id"]


def batch_state(http: httpx.Client, batch_id: str) -> dict:
    resp = http.get(f"/batches/{batch_id}")
    resp.raise_for_status()
    return resp.json()


def wait_batch(http: httpx.Client, batch_id: str, timeout_s: float = 3600.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = batch_state(http, batch_id)
        if state["status"] in ("completed", "failed", "cancelled", "expired"):
            return state
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} did not finish in {timeout_s} s")


def wait_in_progress(http: httpx.Client, batch_id: str) -> None:
    while batch_state(http, batch_id)["status"] in ("validating",):
        time.sleep(0.05)


class ProgressSampler(threading.Thread):
    """Samples (time, completed lines) of a batch every 0.1 s, to count lines within a window."""

    def __init__(self, base_url: str, batch_id: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.batch_id = base_url, batch_id
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            while not self._done.is_set():
                counts = batch_state(http, self.batch_id)["request_counts"]
                self.samples.append((time.monotonic(), counts["completed"]))
                self._done.wait(0.1)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def rate_window(self, t1: float, t2: float) -> tuple[int, float]:
        """Lines completed in [t1, t2], and the part of the window the job was still running."""
        inside = [(t, c) for t, c in self.samples if t1 <= t <= t2]
        if len(inside) < 2:
            return 0, 0.0
        total = self.samples[-1][1]
        end = next((t for t, c in inside if c >= total), inside[-1][0])
        return max(c for t, c in inside if t <= end) - inside[0][1], end - inside[0][0]


def pin(pid: int, core: int) -> None:
    """Every thread of process ``pid`` (threads it starts later inherit it) onto ``core``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # the thread ended meanwhile
            pass


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def server_config(model: str, port: int, name: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {
            "model": model,
            "max_model_len": args.max_model_len,
            "seed": 0,
            "served_model_name": MODEL_NAME,
        },
        "cache": {"block_size": 16, "num_blocks": args.num_blocks, "kv_transfer_port_range": "24400-24699"},
        "scheduler": {
            "max_num_seqs": 64,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "offline_preemption": "step" if name == "step_level" else "layer",
            "offline_max_batched_tokens": args.offline_max_batched_tokens,
        },
        "device": {"device": "cpu", "num_threads": args.threads},
        "service": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "batch": {
            "data_dir": tempfile.mkdtemp(prefix="xllm-coloc-"),
            "max_concurrent_lines": args.batch_concurrency,
        },
    }
    if name != "single_engine":
        cfg["cluster"] = {
            "launch": {"instances": "p0:prefill,d0:decode", "engine_nice": args.engine_nice},
            "registry": {"store": "embedded"},
            "colocation": {"enabled": True},
            "slo": {"tpot_ms": args.tpot_slo_ms},
        }
    else:
        cfg["scheduler"]["offline_preemption"] = "step"  # what one engine did before co-location
        cfg["scheduler"]["offline_max_batched_tokens"] = 0
        cfg["scheduler"]["isolate_online_prefill"] = False
    return cfg


def run_config(name: str, model: str, content: bytes, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    path = Path(tempfile.mkstemp(prefix="xllm-coloc-", suffix=".yaml")[1])
    path.write_text(yaml.safe_dump(server_config(model, port, name, args)))
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(path)]
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(args.threads)}
    with (
        run_server(cmd, port, env=env, name=f"xllm-{name}") as base_url,
        httpx.Client(base_url=base_url, timeout=600) as http,
    ):
        if args.pin and name != "single_engine":  # one core per instance, as numactl would in production
            instances = sorted(http.get("/admin/instances").json()["instances"], key=lambda i: i["name"])
            cores = {inst["name"]: core % (os.cpu_count() or 1) for core, inst in enumerate(instances)}
            for inst in instances:
                pin(inst["pid"], cores[inst["name"]])
            if args.pin_service:  # the API server (the engines' parent) and this client beside decode
                strict = next(i for i in instances if i["role"] == "decode")
                pin(_parent(strict["pid"]), cores[strict["name"]])
                pin(os.getpid(), cores[strict["name"]])
        print(f"[colocation] {name}: warm-up", file=sys.stderr)
        online_phase(base_url, MODEL_NAME, model, args, num_prompts=8)
        print(f"[colocation] {name}: A online alone", file=sys.stderr)
        online_alone = online_phase(base_url, MODEL_NAME, model, args)
        print(f"[colocation] {name}: B batch alone", file=sys.stderr)
        alone_id = submit_batch(http, content)
        wait_in_progress(http, alone_id)
        alone = ProgressSampler(base_url, alone_id)
        alone.start()
        t0 = time.monotonic()
        job = wait_batch(http, alone_id)
        alone.stop()
        done_alone, batch_alone_s = alone.rate_window(t0, time.monotonic())
        print(f"[colocation] {name}: C online during a batch job", file=sys.stderr)
        batch_id = submit_batch(http, content)
        wait_in_progress(http, batch_id)
        progress = ProgressSampler(base_url, batch_id)
        progress.start()
        time.sleep(args.settle_s)  # the job saturates the instances before the online load starts
        t1 = time.monotonic()
        online_shared = online_phase(base_url, MODEL_NAME, model, args)
        t2 = time.monotonic()
        job2 = wait_batch(http, batch_id)
        progress.stop()
        stats = http.get("/admin/stats").json()
        cluster = http.get("/admin/instances").json() if name != "single_engine" else {}
    path.unlink(missing_ok=True)
    lines_alone = done_alone / batch_alone_s if batch_alone_s > 0 else 0.0
    done_during, window_s = progress.rate_window(t1, t2)
    lines_shared = done_during / window_s if window_s > 0 else 0.0
    ttft_alone = online_alone.get("p99_ttft_ms", 0.0)
    out = {
        "online_alone": online_alone,
        "online_with_batch_job": online_shared,
        "online_ttft_p99_ratio": online_shared.get("p99_ttft_ms", 0.0) / max(ttft_alone, 1e-9),
        "batch_alone": {
            "lines": job["request_counts"],
            "window_s": batch_alone_s,
            "lines_per_s": lines_alone,
        },
        "batch_with_online_load": {
            "lines_completed_in_window": done_during,
            "window_s": window_s,
            "lines_per_s": lines_shared,
            "final_status": job2["status"],
        },
        "offline_throughput_ratio": lines_shared / lines_alone if lines_alone else None,
        "offline_tok_per_s": {
            "alone": lines_alone * args.batch_output_len,
            "with_online": lines_shared * args.batch_output_len,
        },
        "engine_colocation_stats": (stats.get("engine") or stats).get("colocation"),
    }
    if cluster:
        out["colocation_view"] = cluster.get("colocation")
    print(
        f"[colocation] {name}: TTFT p99 ratio {out['online_ttft_p99_ratio']:.2f}, "
        f"offline throughput ratio {out['offline_throughput_ratio'] or 0:.2f}",
        file=sys.stderr,
    )
    return out


def run(args: argparse.Namespace) -> dict:
    model = resolve_checkpoint(args)
    content = batch_file(MODEL_NAME, model, args.batch_lines, args.batch_input_len, args.batch_output_len)
    names = [n for n in args.configs.split(",") if n] + (["single_engine"] if args.baselines else [])
    configs = {name: run_config(name, model, content, args) for name in names}
    main = configs.get("colocation") or next(iter(configs.values()))

    def latency(name: str) -> dict | None:
        col = configs[name].get("engine_colocation_stats") or {}
        keys = (
            "num_latencies",
            "preemption_latency_p50_ms",
            "preemption_latency_p99_ms",
            "num_interrupted_steps",
        )
        return {k: col.get(k) for k in keys} if col else None

    return {
        "online_ttft_p99_ratio": main["online_ttft_p99_ratio"],
        "offline_throughput_ratio": main["offline_throughput_ratio"],
        "preemption_latency_ms": {
            mode: latency(name)
            for mode, name in (("layer", "colocation"), ("step", "step_level"))
            if name in configs
        },
        "trace": {
            "online": {
                "n": args.online_requests,
                "rate": args.request_rate,
                "in": args.input_len,
                "out": args.online_output_len,
            },
            "batch": {
                "lines": args.batch_lines,
                "in": args.batch_input_len,
                "out": args.batch_output_len,
                "concurrency": args.batch_concurrency,
            },
            "tpot_slo_ms": args.tpot_slo_ms,
            "threads_per_instance": args.threads,
            "engine_nice": args.engine_nice,
            "model": model,
        },
        "configs": configs,
    }


def online_phase(
    base_url: str, model: str, tokenizer: str, args: argparse.Namespace, num_prompts: int | None = None
) -> dict:
    cfg = ServeConfig(
        base_url=base_url,
        model=model,
        num_prompts=num_prompts or args.online_requests,
        input_len=args.input_len,
        output_len=args.online_output_len,
        shape=LoadShape(request_rate=args.request_rate, burstiness=1.0),
        tokenizer=tokenizer,
        seed=args.seed,
    )
    res = asyncio.run(run_serving_benchmark(cfg))
    out = {k: res[k] for k in _KEEP if k in res}
    out.update({k: v for k, v in res.items() if "_ttft_" in k or "_tpot_" in k})
    return out


SMOKE = dict(
    configs="colocation", online_requests=2, request_rate=50.0, input_len=16, online_output_len=2,
    batch_lines=4, batch_input_len=16, batch_output_len=2, batch_concurrency=2, settle_s=0.0,
    max_model_len=256, num_blocks=128, pin=False,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--online-requests", type=int, default=80)
    p.add_argument("--request-rate", type=float, default=2.0, help="online requests/s (Poisson)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--online-output-len", type=int, default=16)
    p.add_argument("--batch-lines", type=int, default=300)
    p.add_argument("--batch-input-len", type=int, default=512)
    p.add_argument("--batch-output-len", type=int, default=32)
    p.add_argument("--batch-concurrency", type=int, default=16, help="batch lines in flight")
    p.add_argument("--tpot-slo-ms", type=float, default=100.0, help="strict pool's TPOT SLO")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--offline-max-batched-tokens",
        type=int,
        default=256,
        help="scheduler.offline_max_batched_tokens of the co-location configs (0: the step budget)",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per engine instance")
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin each engine instance to its own core (--no-pin: let the OS place them)",
    )
    p.add_argument(
        "--pin-service",
        action="store_true",
        help="with --pin: the API server and this client on the decode (latency-strict) instance's core, "
        "so the prefill core runs prefills only",
    )
    p.add_argument(
        "--engine-nice",
        type=int,
        default=10,
        help="cluster.launch.engine_nice: the engines' nice value, so the API server and this client (nice 0) come "
        "first on cores they share with busy engines (in a deployment they have cores of their own)",
    )
    p.add_argument("--configs", default="colocation,step_level", help="configurations to run, in order")
    p.add_argument("--baselines", action="store_true", help="also run one engine with priorities only")
    p.add_argument("--seed", type=int, default=0)
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse_args(build_parser(), argv, SMOKE)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
