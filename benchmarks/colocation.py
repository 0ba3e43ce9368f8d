"""Online/offline co-location: online TTFT with and without a concurrent batch job, and the job's
throughput with and without online load, measured side by side against one ``xllm serve``.

Three phases on one server: (A) online load alone, (B) a batch job alone, (C) the same online load
while a second, identical batch job runs. Batch lines run as the ``offline`` priority class, so the
engine preempts them for online requests. Job throughput is counted from sampled progress while
the job is in progress: in (B) until it completes, in (C) while the online load runs alongside.

    PYTHONPATH=. .venv/bin/python -m benchmarks.colocation --size tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import threading
import time

import httpx

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.serve import ServeConfig, run_serving_benchmark
from benchmarks.serving.dataset import random_prompts
from benchmarks.serving.load import LoadShape
from benchmarks.xllm_server import xllm_server

_KEEP = ("completed", "failed", "duration_s", "request_throughput", "output_throughput")


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


def online_phase(base_url: str, model: str, tokenizer: str, args: argparse.Namespace) -> dict:
    cfg = ServeConfig(
        base_url=base_url,
        model=model,
        num_prompts=args.online_requests,
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


def run(args: argparse.Namespace) -> dict:
    model_dir = resolve_checkpoint(args)
    data_dir = tempfile.mkdtemp(prefix="xllm-coloc-")
    extra = ["--data-dir", data_dir, "--max-concurrent-lines", str(args.batch_concurrency)]
    extra += ["--num-threads", str(args.num_threads)]
    with (
        xllm_server(model_dir, extra_args=extra) as base_url,
        httpx.Client(base_url=base_url, timeout=600) as http,
    ):
        model = http.get("/models").json()["data"][0]["id"]
        content = batch_file(model, model_dir, args.batch_lines, args.input_len, args.batch_output_len)
        print("[colocation] A: online alone", file=sys.stderr)
        online_alone = online_phase(base_url, model, model_dir, args)
        print("[colocation] B: batch alone", file=sys.stderr)
        alone_id = submit_batch(http, content)
        wait_in_progress(http, alone_id)
        alone = ProgressSampler(base_url, alone_id)
        alone.start()
        t0 = time.monotonic()
        job = wait_batch(http, alone_id)
        alone.stop()
        done_alone, batch_alone_s = alone.rate_window(t0, time.monotonic())
        print("[colocation] C: online during a batch job", file=sys.stderr)
        batch_id = submit_batch(http, content)
        wait_in_progress(http, batch_id)
        progress = ProgressSampler(base_url, batch_id)
        progress.start()
        t1 = time.monotonic()
        online_shared = online_phase(base_url, model, model_dir, args)
        t2 = time.monotonic()
        job2 = wait_batch(http, batch_id)
        progress.stop()
    lines_alone = done_alone / batch_alone_s if batch_alone_s > 0 else 0.0
    done_during, window_s = progress.rate_window(t1, t2)
    lines_shared = done_during / window_s if window_s > 0 else 0.0
    return {
        "model": model_dir,
        "config": {
            k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
            if k != "model"
        },
        "online_alone": online_alone,
        "online_with_batch_job": online_shared,
        "ttft_p99_ratio_with_vs_without_job": online_shared.get("p99_ttft_ms", 0)
        / max(online_alone.get("p99_ttft_ms", 1e-9), 1e-9),
        "batch_alone": {
            "lines": job["request_counts"],
            "lines_completed_in_window": done_alone,
            "window_s": batch_alone_s,
            "lines_per_s": lines_alone,
        },
        "batch_with_online_load": {
            "lines_completed_in_window": done_during,
            "note": "counted while both ran: from the online phase's start until it or the job ended",
            "window_s": window_s,
            "lines_per_s": lines_shared,
            "final_status": job2["status"],
        },
        "batch_throughput_ratio_with_vs_without_online": lines_shared / lines_alone if lines_alone else None,
        "output_tok_per_s_batch_alone": lines_alone * args.batch_output_len,
        "output_tok_per_s_batch_with_online": lines_shared * args.batch_output_len,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--online-requests", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=4.0, help="online requests/s (Poisson)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--online-output-len", type=int, default=32)
    p.add_argument("--batch-lines", type=int, default=1500)
    p.add_argument("--batch-output-len", type=int, default=64)
    p.add_argument("--batch-concurrency", type=int, default=32, help="batch lines in flight")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(build_parser().parse_args(argv)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
