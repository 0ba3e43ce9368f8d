"""The cluster KV store: a ``mooncake_master`` and the memory behind it, in one supervised process.

``python -m xengine.process.kv_store_server --memory-gb 4`` (``xllm kv-store`` runs it) starts the master
on ``--host`` (loopback by default) and becomes the store's memory: a Mooncake Store client that mounts
``--memory-gb`` of segment and serves the records instances put (instances mount none: a record outlives
the instance that wrote it). Its own transfer engine would bind the wildcard address, so the process
re-executes itself under the ``memory.bind_host`` shim, whose environment the master inherits too.
When the master exits it is started again after ``--restart-delay-s`` (its records are gone: instances
see misses until they store again) and the memory re-mounts itself. One JSON line on stdout says ready.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from xengine.api.entrypoints import KV_STORE_MODULE
from xengine.api.lifetime import set_parent_death_signal

logger = logging.getLogger(__name__)

MODULE = KV_STORE_MODULE


def master_binary() -> str:
    """The ``mooncake_master`` of this Python's environment (the wheel installs it), else on PATH."""
    beside = Path(sys.executable).with_name("mooncake_master")
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found is None:
        raise RuntimeError(
            "mooncake_master not found: pip install mooncake-transfer-engine-non-cuda (ci/install_cluster_deps.sh)"
        )
    return found


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class StoreServer:
    def __init__(
        self, host: str, port: int, metrics_port: int, memory_bytes: int, restart_delay_s: float
    ) -> None:
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.memory_bytes = memory_bytes
        self.restart_delay_s = restart_delay_s
        self.master: subprocess.Popen[bytes] | None = None
        self.client = None
        self.num_master_starts = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start_master(self, timeout_s: float = 30.0) -> None:
        cmd = [
            master_binary(),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}",
            f"-http_metadata_server_host={self.host}",
            "-enable_http_metadata_server=false",
            "-logtostderr=false",
        ]
        self.master = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=set_parent_death_signal
        )  # the master goes with this process, however it ends
        self.num_master_starts += 1
        deadline = time.monotonic() + timeout_s
        while not _port_open(self.host, self.port):
            if self.master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mooncake_master did not start on {self.address} (exit {self.master.poll()})"
                )
            time.sleep(0.05)

    def mount_memory(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        rc = client.setup(self.host, "P2PHANDSHAKE", self.memory_bytes, 16 << 20, "tcp", "", self.address)
        if rc != 0:
            raise RuntimeError(
                f"mounting {self.memory_bytes} bytes of store memory failed (setup returned {rc})"
            )
        self.client = client

    def watch(self) -> None:
        """Restart the master whenever it exits (the memory re-mounts itself), until SIGTERM."""
        while True:
            assert self.master is not None
            code = self.master.wait()
            logger.warning(
                "mooncake_master exited (%s); starting it again in %.1fs", code, self.restart_delay_s
            )
            time.sleep(self.restart_delay_s)
            self.start_master()

    def stop(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.terminate()
            try:
                self.master.wait(5)
            except subprocess.TimeoutExpired:
                self.master.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="Address the master and the memory listen on.")
    p.add_argument("--port", type=int, default=50051, help="The master's RPC port (kv_tiers.store_master).")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="The master's HTTP metrics port (default port+1)."
    )
    p.add_argument("--memory-gb", type=float, default=4.0, help="Store memory this process mounts, in GiB.")
    p.add_argument("--parent-pid", type=int, default=None, help="Exit when this is no longer the parent.")
    p.add_argument(
        "--restart-delay-s", type=float, default=1.0, help="Wait before restarting a master that exited."
    )
    args = p.parse_args(argv)
    if args.memory_gb <= 0:
        p.error("--memory-gb must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kv-store %(levelname)s %(message)s")
    if args.parent_pid is not None:  # started by a service: it goes with it
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != args.parent_pid:
            return 0
    from memory.bind_host import exec_env
    from xengine.api.paths import cache_dir

    env = exec_env(args.host, os.environ, cache_dir())
    if env is not None:  # the memory's transfer engine (and the master) bind --host, not the wildcard
        sys.stderr.flush()
        os.execve(
            sys.executable, [sys.executable, "-m", MODULE, *(sys.argv[1:] if argv is None else argv)], env
        )
    server = StoreServer(
        args.host,
        args.port,
        args.metrics_port or args.port + 1,
        int(args.memory_gb * (1 << 30)),
        args.restart_delay_s,
    )

    def _term(signum: int, frame: object) -> None:
        server.stop()
        os._exit(0)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    try:
        server.start_master()
        server.mount_memory()
    except RuntimeError as e:
        server.stop()
        print(f"xllm: error: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps({"ready": True, "store_master": server.address, "memory_gb": args.memory_gb}), flush=True
    )
    server.watch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
