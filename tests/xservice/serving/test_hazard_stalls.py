"""Hazard corpus, stalls: legal-size bodies that are costly to refuse do not stall everyone else.

Eight chat bodies of 100k text parts (3.1 MB each, under the 4 MiB body bound), one of 10k tools and one of
200k ``logit_bias`` keys, sent at once from another process, each get a 400 naming the field, while a
greedy stream runs and ``/health/live`` is probed. Before the counts and the off-loop parsing, each chat
body held the event loop ~1.4 s (the eight: a 3.5-9 s token gap and a 9-12 s ``/health/live`` answer).

The bound is relative to the same run: the worst token gap (and probe latency) while the load is in flight
is compared with the worst over as many tokens of the same stream afterwards, unloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

RATIO = 3.0  # the loaded worst may be this multiple of the baseline worst ...
MARGIN_S = 0.5  # ... plus this much (one 4 MB JSON decode on a busy 2-core box is ~0.1 s)
WARMUP_TOKENS = 50
PROBE_EVERY_S = 0.02
TIMEOUT_S = 300.0  # guards against a hang, not a timing assertion

STREAM = {
    "prompt": "Once upon a time",
    "max_tokens": 4000,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}

# Builds the bodies, says "ready", sends them all at once on "go", prints [[name, status, error], ...].
SENDER = r"""
import json, sys, threading, httpx
url = sys.argv[1]
parts = [{"type": "text", "text": "x"} for _ in range(100_000)]
chat = {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}
tools = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
         "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                   for i in range(10_000)]}
bias = {"prompt": "hi", "max_tokens": 4, "logit_bias": {str(i): 1 for i in range(200_000)}}
bodies = [("parts", "/v1/chat/completions", chat)] * 8 + [
    ("tools", "/v1/chat/completions", tools), ("logit_bias", "/v1/completions", bias)]
encoded = [(name, path, json.dumps(body).encode()) for name, path, body in bodies]
out = []
def send(name, path, data):
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.post(path, content=data, headers={"Content-Type": "application/json"})
        out.append([name, r.status_code, r.json().get("error") if r.status_code >= 400 else None])
print("ready", flush=True)
sys.stdin.readline()
threads = [threading.Thread(target=send, args=e) for e in encoded]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out), flush=True)
"""
EXPECTED_PARAMS = {"parts": "messages.0.content", "tools": "tools", "logit_bias": "logit_bias"}


class Watch:
    """Greedy streams back to back (each token's gap since the previous one of its stream) and
    ``/health/live`` probes (each one's latency), from two threads, until ``stop``."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.gaps: list[tuple[float, float]] = []  # (arrival, gap)
        self.probes: list[tuple[float, float]] = []  # (start, latency)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream), threading.Thread(target=self._probe)]

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(TIMEOUT_S)

    def _stream(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=TIMEOUT_S) as http:
            while not self._stop.is_set():
                with http.stream("POST", "/v1/completions", json=STREAM) as resp:
                    if resp.status_code != 200:
                        self.errors.append(f"stream: {resp.status_code}")
                        return
                    last = None
                    for line in resp.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append((now, now - last))
                        last = now
                        if self._stop.is_set():
                            return

    def _probe(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=TIMEOUT_S) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                status = http.get("/health/live").status_code
                self.probes.append((start, time.perf_counter() - start))
                if status != 200:
                    self.errors.append(f"/health/live: {status}")
                self._stop.wait(
                    PROBE_EVERY_S
                )  # the probing rate, as an orchestrator's (not a wait for state)

    def wait_tokens(self, count: int, after: float = 0.0) -> None:
        """Wait until ``count`` gaps have arrived after time ``after``."""
        deadline = time.monotonic() + TIMEOUT_S
        while sum(1 for t, _ in self.gaps if t > after) < count:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, "the stream stopped"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def stall_server(launch_server, model_dir) -> Iterator[Any]:
    """Default body bound and limits; a context long enough for a stream that outlasts the load."""
    handle = launch_server(model_dir, {}, engine={"model": {"max_model_len": 4096}})
    yield handle
    handle.stop()


def worst(samples: list[tuple[float, float]], start: float, end: float) -> float:
    window = [value for t, value in samples if start <= t <= end]
    assert window, "no samples in the window"
    return max(window)


def test_costly_bodies_are_refused_without_stalling_streams(stall_server: Any) -> None:
    with stall_server.client() as http:
        engine_pid = http.get("/v1/admin/stats").json()["engine_pid"]
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, stall_server.base_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout.readline().strip() == "ready"
        with Watch(stall_server.base_url) as watch:
            watch.wait_tokens(WARMUP_TOKENS)
            load_start = time.perf_counter()
            sender.stdin.write("go\n")
            sender.stdin.flush()
            results = json.loads(sender.stdout.readline())
            load_end = time.perf_counter()
            watch.wait_tokens(10, after=load_end)  # a stall that spans the end shows in a later gap
            load_end = next(t for t, _ in watch.gaps if t > load_end)
            num_loaded = sum(1 for t, _ in watch.gaps if load_start <= t <= load_end)
            watch.wait_tokens(num_loaded, after=load_end)  # the baseline: as many tokens, unloaded
            base_end = [t for t, _ in watch.gaps if t > load_end][num_loaded - 1]
        assert not watch.errors, watch.errors
    finally:
        sender.kill()
        sender.wait()

    assert len(results) == 10
    for name, status, error in results:
        assert status == 400, (name, status, error)
        assert error["param"] == EXPECTED_PARAMS[name] and error["code"] == "array_above_max_length", error

    loaded_gap = worst(watch.gaps, load_start, load_end)
    base_gap = worst(watch.gaps, load_end, base_end)
    loaded_probe = worst(watch.probes, load_start, load_end)
    base_probe = worst(watch.probes, load_end, base_end)
    print(
        f"worst token gap: {loaded_gap * 1000:.0f} ms under load ({num_loaded} tokens, "
        f"{load_end - load_start:.2f} s), {base_gap * 1000:.0f} ms unloaded; worst /health/live: "
        f"{loaded_probe * 1000:.0f} ms under load, {base_probe * 1000:.0f} ms unloaded"
    )
    assert loaded_gap <= RATIO * base_gap + MARGIN_S, (loaded_gap, base_gap)
    assert loaded_probe <= RATIO * base_probe + MARGIN_S, (loaded_probe, base_probe)

    with stall_server.client() as http:  # the same engine serves on
        assert http.get("/v1/admin/stats").json()["engine_pid"] == engine_pid
        resp = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
