"""A restarted service rebuilds its routing state from etcd; engines outlive it (attach mode).

Real etcd, two standalone engines (``xllm engine`` subprocesses) and two successive services
(``xllm serve`` with ``cluster.launcher: external``). Service A serves a long generation R (on
engine-0) and a shared-prefix prompt P (on engine-1, the idle one), persists engine-1's KV set
under ``<prefix>/kv/engine-1``, and is killed with ``kill -9``. The engines stay registered.

Before service B starts, the test deletes engine-1's live ``kv_events`` key (its last batch, which
would also name P's blocks), and engine-1 has no cache change afterwards, so it publishes nothing
new: the persisted snapshot is B's only source for P's blocks. B must then show them indexed before
it serves anything, and route a follow-up sharing P to engine-1 with a prefix hit. Without the
rebuild B's index would be empty and ``cache_aware`` would break the tie by name: engine-0.

R was still running on engine-0 when A died: engine-0 aborts it when B says hello (it drops R's
outputs), and B serves engine-0 normally.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.xservice.cluster.helpers import EtcdServer, free_port

ROOT = Path(__file__).resolve().parents[3]
PREFIX = "/xllm-restart"
BLOCK = 16
STARTUP_TIMEOUT_S = 300.0  # guards a broken build, not a timing assertion
SHARED = "You are a helpful assistant. Answer briefly and precisely. " * 8  # ~8 whole blocks
# R: as long as the tiny model's 4096 positions allow, and four sequences of it (n=4) to make its steps
# slower, so only an abort ends it: one sequence of 3500 tokens took ~5.4 s here, about the time the
# test takes to bring the second service up
LONG_MAX_TOKENS, LONG_N = 3500, 4
# a short lease keeps the wait for "heartbeats spanning more than a lease" short (8 heartbeats of slack)
LEASE_TTL_S, HEARTBEAT_S = 2.0, 0.25
LEASE_HEARTBEATS = int(LEASE_TTL_S / HEARTBEAT_S)  # heartbeats in one lease


def _config(tmp_path: Path, model_dir: Path, etcd: EtcdServer) -> Path:
    cfg = {
        "model": {
            "model": str(model_dir),
            "max_model_len": 4096,
            "seed": 0,
            "served_model_name": "xllm-tiny",
        },
        "cache": {"block_size": BLOCK, "num_blocks": 400},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
        "device": {"device": "cpu", "num_threads": 1},
        "service": {"host": "127.0.0.1", "port": 0, "log_level": "warning"},
        "cluster": {
            "launcher": "external",
            "instances": "engine-0,engine-1",  # attach mode: the names to wait for
            "metadata_store": "etcd",
            "etcd_endpoint": etcd.endpoint,
            "key_prefix": PREFIX,
            "routing_policy": "cache_aware",
            "lease_ttl_s": LEASE_TTL_S,
            "heartbeat_interval_s": HEARTBEAT_S,
        },
    }
    path = tmp_path / "cluster-external.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _xllm(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "xservice", *args], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, cwd=str(ROOT), start_new_session=True,
        )  # fmt: skip


class Service:
    """``xllm serve --config FILE --port P`` in attach mode."""

    def __init__(self, config: Path, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.proc = _xllm(["serve", "--config", str(config), "--port", str(self.port)], log)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60.0)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                if self.http.get("/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"service not ready:\n{log.read_text()[-3000:]}")

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0)

    def instances(self) -> dict[str, dict[str, Any]]:
        return {i["name"]: i for i in self.http.get("/v1/admin/instances").json()["instances"]}

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.http.close()
        _stop(self.proc, sig)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _etcd(etcd: EtcdServer, op: Callable[[Any], Any]) -> Any:
    from xengine.api.cluster.store.etcd import EtcdStore

    async def run() -> Any:
        store = EtcdStore("127.0.0.1", etcd.port)
        try:
            return await op(store)
        finally:
            await store.close()

    return asyncio.run(run())


def _keys(etcd: EtcdServer, kind: str) -> dict[str, bytes]:
    async def read(store: Any) -> dict[str, bytes]:
        data, _ = await store.get_prefix(f"{PREFIX}/{kind}/")
        return {k.rsplit("/", 1)[1]: v for k, v in data.items()}

    return _etcd(etcd, read)


def _incarnations(etcd: EtcdServer) -> dict[str, str]:
    """The registered incarnation of each instance name."""
    from xengine.api.cluster import keys

    return {
        n: keys.decode(raw, keys.InstanceRecord).incarnation for n, raw in _keys(etcd, "instances").items()
    }


def _load_seqs(etcd: EtcdServer) -> dict[str, int]:
    """Each engine's latest heartbeat (load report) number."""
    from xengine.api.cluster import keys

    return {name: keys.decode(raw, keys.LoadReport).seq for name, raw in _keys(etcd, "load").items()}


def _persisted_blocks(etcd: EtcdServer, name: str) -> int:
    from xengine.api.cluster import keys

    snap = keys.decode(_keys(etcd, "kv").get(name, b""), keys.KVSnapshot)
    return len(snap.hashes) if snap is not None else 0


def wait_until(cond: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def complete(
    client: openai.OpenAI, prompt: str, max_tokens: int = 4, stream: bool = False, n: int = 1
) -> Any:
    return client.completions.create(
        model="xllm-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream, n=n,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


@pytest.fixture
def engines(
    etcd: EtcdServer,
    model_dir: Path,
    tmp_path: Path,
) -> Iterator[tuple[Path, list[Path]]]:
    config = _config(tmp_path, model_dir, etcd)
    logs = [tmp_path / f"engine-{i}.log" for i in range(2)]
    procs = [
        _xllm(["engine", "--config", str(config), "--name", f"engine-{i}", "--role", "mixed"], logs[i])
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while sorted(_keys(etcd, "instances")) != ["engine-0", "engine-1"]:
            for proc, log in zip(procs, logs):
                assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "engines did not register"
            time.sleep(0.2)
        yield config, logs
    finally:
        for proc in procs:
            _stop(proc)
        for proc in procs:
            assert proc.returncode is not None


def test_restarted_service_rebuilds_its_prefix_index_from_etcd(
    engines: tuple[Path, list[Path]],
    etcd: EtcdServer,
    tmp_path: Path,
) -> None:
    config, engine_logs = engines
    a = Service(config, tmp_path / "service-a.log")
    b: Service | None = None
    try:
        assert sorted(a.instances()) == ["engine-0", "engine-1"]
        # R: a long generation; both instances are idle, so the tie goes to engine-0 (by name)
        r_chunks: list[str] = []
        r_result: dict[str, Any] = {}

        def stream_r() -> None:
            try:
                for chunk in complete(
                    a.openai(), "Tell me a long story.", LONG_MAX_TOKENS, stream=True, n=LONG_N
                ):
                    if chunk.choices[0].index == 0:  # one sequence's tokens
                        r_chunks.append(chunk.choices[0].text)
            except Exception as e:  # noqa: BLE001 - the service is killed under it
                r_result["error"] = repr(e)

        r_thread = threading.Thread(target=stream_r, daemon=True)
        r_thread.start()
        wait_until(lambda: len(r_chunks) >= 3, 30, "R to stream")
        assert a.instances()["engine-0"]["num_inflight"] == 1

        # P: the shared prefix goes to the idle engine-1
        out = complete(a.openai(), SHARED + "Question one?")
        n_blocks = out.usage.prompt_tokens // BLOCK
        assert n_blocks >= 6
        routed = {n: i["num_routed"] for n, i in a.instances().items()}
        assert routed == {"engine-0": 1, "engine-1": 1}
        wait_until(lambda: a.instances()["engine-1"]["num_kv_blocks_indexed"] >= n_blocks, what="KV events")
        wait_until(lambda: _persisted_blocks(etcd, "engine-1") >= n_blocks, 5, "A to persist the KV index")

        # engine-1's latest KV event batch (which names P's blocks too) goes away; engine-1 stays idle,
        # so from now on only the persisted snapshot knows what it holds
        assert _etcd(etcd, lambda s: s.delete(f"{PREFIX}/kv_events/engine-1"))
        a.stop(signal.SIGKILL)
        r_thread.join(10)
        assert "error" in r_result  # R's client lost its service
        r_tokens_at_kill = len(r_chunks)
        assert r_tokens_at_kill < LONG_MAX_TOKENS

        # the engines stay registered without any service: heartbeats spanning more than a lease
        # (each renews it), from the same incarnations
        registered = _incarnations(etcd)
        assert sorted(registered) == ["engine-0", "engine-1"]
        seqs = _load_seqs(etcd)
        wait_until(
            lambda: all(n - seqs[name] > LEASE_HEARTBEATS for name, n in _load_seqs(etcd).items()),
            STARTUP_TIMEOUT_S,
            "heartbeats without a service",
        )
        assert _incarnations(etcd) == registered

        b = Service(config, tmp_path / "service-b.log")
        view = b.instances()
        assert view["engine-1"]["num_kv_blocks_indexed"] >= n_blocks, view
        assert view["engine-0"]["num_kv_blocks_indexed"] >= 1  # engine-0's (from the live kv_events)
        assert "engine-1" not in _keys(etcd, "kv_events")  # engine-1 published nothing new: B read /kv
        assert "prefix index rebuilt from the store" in (tmp_path / "service-b.log").read_text()

        # R, still running on engine-0, was aborted by B's hello (its outputs dropped)
        wait_until(lambda: "aborting 1 request(s)" in engine_logs[0].read_text(), 10, "engine-0 to abort R")
        wait_until(
            lambda: (b.instances()["engine-0"]["load"] or {"num_running": 1})["num_running"] == 0,
            5,
            "engine-0 to report R gone",
        )

        # the very first follow-up sharing P: routed by the rebuilt index to engine-1, a prefix hit
        out = complete(b.openai(), SHARED + "Question two?")
        assert out.usage.prompt_tokens_details.cached_tokens >= (n_blocks - 1) * BLOCK
        view = b.instances()
        assert (view["engine-0"]["num_routed"], view["engine-1"]["num_routed"]) == (0, 1)

        # engine-0 (which had R) serves B normally
        out = complete(b.openai(), "A fresh question for engine zero?", max_tokens=8)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
        assert b.instances()["engine-0"]["num_routed"] == 1

        # stopping B leaves the engines registered
        b.stop()
        b = None
        assert sorted(_keys(etcd, "instances")) == ["engine-0", "engine-1"]
    finally:
        a.stop(signal.SIGKILL)
        if b is not None:
            b.stop()
