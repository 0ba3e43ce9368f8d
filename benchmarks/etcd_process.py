"""A loopback-only etcd server for a benchmark's lifetime (the ``etcd`` binary: ci/install_cluster_deps.sh)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.server_process import free_port

START_TIMEOUT_S = 30.0


@contextlib.contextmanager
def run_etcd() -> Iterator[str]:
    """Start etcd on free loopback ports with a temporary data dir; yield its ``HOST:PORT`` endpoint."""
    if shutil.which("etcd") is None:
        raise SystemExit("etcd not found: run ci/install_cluster_deps.sh")
    data_dir = Path(tempfile.mkdtemp(prefix="xllm-bench-etcd-"))
    port, peer_port = free_port(), free_port()
    client, peer = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer_port}"
    cmd = [
        "etcd", "--name", "xllm-bench", "--data-dir", str(data_dir / "data"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"xllm-bench={peer}",
    ]  # fmt: skip
    log_path = data_dir / "etcd.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready to serve client requests" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        print(f"etcd ready at 127.0.0.1:{port}", file=sys.stderr)
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
