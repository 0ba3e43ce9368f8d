"""The service's per-token work at 16-64 streams: CPU per delivered token of ``xllm serve``'s API
server (engine-output routing, detokenizing, SSE encoding, usage) apart from its engine's.

Starts a real ``xllm serve`` on a generated checkpoint (the tiny one by default: its forward is
fast, so the service's share is what loads the machine), then for each ``--concurrency`` N runs N
streaming ``/v1/completions`` clients at once (``ignore_eos``, ``--max-tokens`` each, requests in a
row until about ``--tokens-per-level`` tokens were delivered) and reads the CPU time (``/proc/PID/stat`` utime + stime) of
the service processes and of the engine process over the wave. Per N it reports tokens/s delivered,
service and engine CPU microseconds per delivered token and the ITL p50. The claim it checks:
nothing per token grows with the number of streams, so service µs per token stays about flat from
16 to 64 streams (``service_us_per_token_ratio``: the largest N's over the smallest's). ITL is what
the client saw; the client shares the machine, and when it falls behind it reads several chunks of a
stream at once, so on a small box the p50 can be far below the step time (``itl_mean_ms`` is not).

    PYTHONPATH=. .venv/bin/python -m benchmarks.front_door --concurrency 16 32 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.machine import describe
from benchmarks.server_process import free_port, stop, wait_ready
from benchmarks.serving.metrics import percentile
from benchmarks.smoke import add_smoke_flag, parse_args
from benchmarks.xllm_server import REPO_ROOT, xllm_server_cmd
from xengine.api.entrypoints import ENGINE_PROC_MODULE

PROMPT = "The quick brown fox jumps over the lazy dog while the service streams every token to"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- process CPU time


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime in seconds) of ``pid``; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class ServerProcesses:
    """The pids of one ``xllm serve``: its service processes (the watchdog and the API server) and
    its engine processes (``ENGINE_PROC_MODULE`` and anything below it)."""

    service: tuple[int, ...]
    engine: tuple[int, ...]

    @classmethod
    def find(cls, root: int) -> ServerProcesses:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _stat(int(entry))) is not None:
                parents[int(entry)] = st[0]
        service, engine = [], []

        def walk(pid: int, in_engine: bool) -> None:
            in_engine = in_engine or ENGINE_PROC_MODULE in _cmdline(pid)
            (engine if in_engine else service).append(pid)
            for child in sorted(p for p, pp in parents.items() if pp == pid):
                walk(child, in_engine)

        walk(root, False)
        return cls(tuple(service), tuple(engine))

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds used so far by (the service processes, the engine processes)."""

        def total(pids: tuple[int, ...]) -> float:
            return sum(st[1] for pid in pids if (st := _stat(pid)) is not None)

        return total(self.service), total(self.engine)


@contextlib.contextmanager
def serve(model_dir: str, extra_args: list[str]) -> Iterator[tuple[str, ServerProcesses]]:
    """``xllm serve`` on ``model_dir``: yields its base URL and its processes, stops it on exit."""
    port = free_port()
    cmd = xllm_server_cmd(model_dir, port, extra_args)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    log = Path(tempfile.mkstemp(prefix="xllm-front-door-", suffix=".log")[1])
    print(f"starting xllm: {' '.join(cmd)} (log: {log})", file=sys.stderr)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}/v1"
            wait_ready(base_url, proc, 600.0, log)
            procs = ServerProcesses.find(proc.pid)
            if not procs.engine:
                raise RuntimeError(f"no engine process ({ENGINE_PROC_MODULE}) under pid {proc.pid}")
            yield base_url, procs
        finally:
            stop(proc)
    log.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- load


@dataclass
class StreamRecord:
    """What one streamed request delivered: its completion tokens (from the usage chunk) and the
    gaps between its output chunks."""

    tokens: int = 0
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    error: str = ""


def _payload(model: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream_once(session: aiohttp.ClientSession, url: str, payload: dict) -> StreamRecord:
    """One streaming request; only the usage chunk is parsed, so the client stays cheap next to the
    server it loads. Never raises (an error lands in the record)."""
    rec = StreamRecord()
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                if not raw.startswith(b"data: {"):
                    continue
                if b'"choices":[]' in raw:  # the usage chunk
                    rec.tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()
                if num_chunks:
                    rec.gaps_s.append(now - last)
                else:
                    rec.ttft_s = now - start
                last, num_chunks = now, num_chunks + 1
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, KeyError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if not rec.error and rec.tokens == 0:
        rec.error = "no usage chunk"
    return rec


async def _wave(url: str, payload: dict, concurrency: int, requests_per_client: int) -> list[StreamRecord]:
    """``concurrency`` clients at once, each sending ``requests_per_client`` streaming requests in a row."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as s:

        async def client() -> list[StreamRecord]:
            return [await _stream_once(s, url, payload) for _ in range(requests_per_client)]

        per_client = await asyncio.gather(*(client() for _ in range(concurrency)))
    return [r for records in per_client for r in records]


def run_level(
    base_url: str, model: str, procs: ServerProcesses, concurrency: int, max_tokens: int, num_tokens: int
) -> dict:
    """One wave of about ``num_tokens`` tokens at ``concurrency`` streams: throughput, CPU per
    delivered token, ITL."""
    requests_per_client = max(1, math.ceil(num_tokens / (concurrency * max_tokens)))
    url, payload = f"{base_url}/completions", _payload(model, max_tokens)
    service0, engine0 = procs.cpu_s()
    client0, t0 = time.process_time(), time.perf_counter()
    records = asyncio.run(_wave(url, payload, concurrency, requests_per_client))
    wall = time.perf_counter() - t0
    client_cpu = time.process_time() - client0
    service1, engine1 = procs.cpu_s()
    done = [r for r in records if not r.error]
    tokens = sum(r.tokens for r in done)
    per_token_us = 1e6 / max(tokens, 1)
    itl_ms = [g * 1000.0 for r in done for g in r.gaps_s]
    out = {
        "concurrency": concurrency,
        "requests": len(records),
        "failed": len(records) - len(done),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "service_cpu_s": round(service1 - service0, 3),
        "service_us_per_token": round((service1 - service0) * per_token_us, 1),
        "engine_cpu_s": round(engine1 - engine0, 3),
        "engine_us_per_token": round((engine1 - engine0) * per_token_us, 1),
        "client_us_per_token": round(client_cpu * per_token_us, 1),
        "itl_p50_ms": round(percentile(itl_ms, 50), 3),
        "itl_p99_ms": round(percentile(itl_ms, 99), 3),
        "itl_mean_ms": round(sum(itl_ms) / len(itl_ms), 3) if itl_ms else 0.0,
        "ttft_p50_ms": round(percentile([r.ttft_s * 1000.0 for r in done], 50), 1),
    }
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:3]
    return out


def _served_model(base_url: str) -> str:
    import httpx

    return httpx.get(f"{base_url}/models", timeout=10.0).json()["data"][0]["id"]


# ---------------------------------------------------------------------------- program


SMOKE = dict(concurrency=[2], max_tokens=8, tokens_per_level=16, warmup_tokens=2)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64], help="streams per wave")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (ignore_eos)")
    p.add_argument(
        "--tokens-per-level",
        type=int,
        default=32768,
        help="tokens each wave delivers (about): each client sends that / (streams x max tokens) requests",
    )
    p.add_argument(
        "--warmup-tokens", type=int, default=8, help="tokens per request of a first, unmeasured wave"
    )
    p.add_argument(
        "--engine-threads", type=int, default=1, help="the engine's compute threads (--num-threads)"
    )
    add_smoke_flag(p)
    return p


def _ratio(levels: list[dict], key: str) -> float | None:
    """``key`` of the largest concurrency over that of the smallest (None with one level)."""
    if len(levels) < 2 or not levels[0][key]:
        return None
    return round(levels[-1][key] / levels[0][key], 3)


def main(argv: list[str] | None = None) -> int:
    """Start the server, run each concurrency level, print one JSON document."""
    args = parse_args(build_parser(), argv, SMOKE)
    model_dir = resolve_checkpoint(args)
    levels = sorted(args.concurrency)
    max_seqs = max(64, *levels)
    extra = ["--num-threads", str(args.engine_threads), "--max-num-seqs", str(max_seqs)]
    extra += ["--max-pending-requests", str(max(512, 2 * max_seqs)), "--log-level", "warning"]
    report: dict = {
        "benchmark": "front_door",
        "command": " ".join([sys.executable, "-m", "benchmarks.front_door", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "model": model_dir,
        "settings": {k: v for k, v in vars(args).items() if k not in ("model",)},
        "machine": describe(threads_per_process=args.engine_threads),
    }
    with serve(model_dir, extra) as (base_url, procs):
        report["pids"] = {"service": list(procs.service), "engine": list(procs.engine)}
        model = _served_model(base_url)
        # the first requests pay one-off costs (imports, caches)
        run_level(base_url, model, procs, levels[-1], args.warmup_tokens, 1)
        results = []
        for n in levels:
            print(f"concurrency {n}", file=sys.stderr)
            results.append(run_level(base_url, model, procs, n, args.max_tokens, args.tokens_per_level))
    report["levels"] = results
    report["service_us_per_token_ratio"] = _ratio(results, "service_us_per_token")
    print(json.dumps(report, indent=2))
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
