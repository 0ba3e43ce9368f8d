"""Shared by the cluster tests: a real loopback etcd (``EtcdServer``; the ``etcd`` fixture is in this
folder's ``conftest.py``) and a real ``xllm serve`` in cluster mode (``ClusterServer``), with the
polling and request helpers the tests drive them with.

``EtcdServer`` runs etcd on free ports with a temporary data dir; ``stop()`` / ``start()`` keep the
data dir, so a restart keeps the data.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

ETCD_START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    def __init__(self) -> None:
        self.port, self.peer_port = free_port(), free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="xllm-etcd-test-"))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            "etcd", "--name", "xllm-test", "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"xllm-test={peer}",
        ]  # fmt: skip
        log = open(self.data_dir / "etcd.log", "ab")  # noqa: SIM115 - kept open by the child
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError((self.data_dir / "etcd.log").read_text()[-2000:])
            if "ready to serve client requests" in (self.data_dir / "etcd.log").read_text(errors="replace"):
                return
            time.sleep(0.05)
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


ROOT = Path(__file__).resolve().parents[3]


TTL_S, HEARTBEAT_S = 3.0, 0.5


STARTUP_TIMEOUT_S = 300.0  # guards a broken build, not a timing assertion


ENGINE = {
    "model": {"max_model_len": 256, "seed": 0, "served_model_name": "xllm-tiny"},
    "cache": {"block_size": 16, "num_blocks": 320},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
    "device": {"device": "cpu", "num_threads": 1},
}


PROMPTS = [f"Story {i}: once upon a time in a land far away there lived a" for i in range(4)]


class ClusterServer:
    def __init__(
        self,
        model_dir: Path,
        cluster: dict[str, Any],
        service: dict[str, Any] | None = None,
        engine: dict[str, dict[str, Any]] | None = None,  # per-section overrides of ENGINE
    ) -> None:
        self.port = free_port()
        cfg = {k: {**ENGINE.get(k, {}), **(engine or {}).get(k, {})} for k in {*ENGINE, *(engine or {})}}
        cfg["model"]["model"] = str(model_dir)
        cfg["service"] = {"host": "127.0.0.1", "port": self.port, "log_level": "warning", **(service or {})}
        cfg["cluster"] = cluster
        fd, log_name = tempfile.mkstemp(prefix="xllm-cluster-test-", suffix=".log")
        self.log_path = Path(log_name)
        self.config_path = self.log_path.with_suffix(".yaml")
        self.config_path.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "xservice", "serve", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(ROOT),
            )  # fmt: skip
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60.0)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                if self.http.get("/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready:\n{self.log_path.read_text()[-3000:]}")

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0)

    def admin(self) -> dict[str, Any]:
        return self.http.get("/v1/admin/instances").json()

    def instances(self) -> dict[str, dict[str, Any]]:
        return {i["name"]: i for i in self.admin()["instances"]}

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.config_path.unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)


def colocated_texts(
    model_dir: Path, prompts: list[tuple[str, int]], max_model_len: int = ENGINE["model"]["max_model_len"]
) -> dict[str, str]:
    """Greedy texts (``ignore_eos``, ``n`` tokens per prompt) of one colocated offline ``LLM`` with the
    instances' settings: what every cluster path must reproduce."""
    import gc

    from xengine.api.messages import SamplingParams
    from xengine.llm import LLM

    llm = LLM(
        model=str(model_dir),
        max_model_len=max_model_len,
        seed=ENGINE["model"]["seed"],
        block_size=ENGINE["cache"]["block_size"],
        num_blocks=ENGINE["cache"]["num_blocks"],
        device="cpu",
        num_threads=1,
    )
    out = {}
    for prompt, n in prompts:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        out[prompt] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    del llm
    gc.collect()
    return out


def wait_until(cond, timeout_s: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def freeze_a_busy_instance(
    cluster: ClusterServer, eligible: Callable[[dict[str, Any]], bool] = lambda i: True
) -> dict[str, Any] | None:
    """SIGSTOP the eligible instance with the most requests in flight, and return it if the service
    still counts requests in flight on it once frozen (else wake it and return None: try again).
    Frozen, its streams cannot finish before the fault a test injects next."""
    candidates = [i for i in cluster.instances().values() if eligible(i)]
    victim = max(candidates, key=lambda i: i["num_inflight"], default=None)
    if victim is None or victim["num_inflight"] == 0:
        return None
    os.kill(victim["pid"], signal.SIGSTOP)
    if cluster.instances()[victim["name"]]["num_inflight"] > 0:
        return victim
    os.kill(victim["pid"], signal.SIGCONT)  # its streams ended just before the freeze
    return None


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 8, stream: bool = False) -> Any:
    return client.completions.create(
        model="xllm-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def stream_completion(client: openai.OpenAI, prompt: str, out: dict[str, Any], key: str) -> None:
    chunks = out.setdefault(key, [])
    try:
        for chunk in complete(client, prompt, max_tokens=200, stream=True):  # outlasts the kill below
            chunks.append(chunk.choices[0].text)
            out[key + ":finish"] = chunk.choices[0].finish_reason or out.get(key + ":finish")
    except Exception as e:  # noqa: BLE001 - reported by the assertion below
        out[key + ":error"] = repr(e)


def start_streams(client: openai.OpenAI, out: dict[str, Any]) -> list[threading.Thread]:
    """One streaming completion per prompt of ``PROMPTS``, each on its thread, collected into ``out``."""
    threads = [
        threading.Thread(target=stream_completion, args=(client, p, out, str(i)))
        for i, p in enumerate(PROMPTS)
    ]
    [t.start() for t in threads]
    return threads


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            children.setdefault(ppid(int(entry)), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def tcp_listeners(pids: set[int]) -> dict[int, list[tuple[str, int]]]:
    """``ss -ltnp``: ``{pid: [(address, port)]}`` of the TCP listeners of ``pids``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found: dict[int, list[tuple[str, int]]] = {}
    for line in out.splitlines():
        host, _, port = line.split()[3].rpartition(":")
        for pid in {int(p) for p in re.findall(r"pid=(\d+),", line)} & pids:
            found.setdefault(pid, []).append((host.strip("[]"), int(port)))
    return found
