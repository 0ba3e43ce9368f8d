"""``xllm kv-store``: the cluster KV store the ``kv_tiers.store_master`` setting points at.

``xllm kv-store [--host 127.0.0.1] [--port 50051] [--memory-gb 4]`` becomes (exec) ``python -m
xengine.process.kv_store_server``: a ``mooncake_master`` on ``--host`` and the store memory behind it, the
master restarted if it exits. Engine instances started with ``--store-master HOST:PORT`` share prompt
KV through it (``docs/kv_tiers.md``). Ctrl-C / SIGTERM stops both.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from xengine.api.entrypoints import KV_STORE_MODULE
from xservice.engine.process import child_env


def register_kv_store(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "kv-store",
        help="run the cluster KV store (mooncake_master and its memory) for kv_tiers.store_master",
        description="Run a mooncake_master and the store memory behind it, bound to --host (loopback by "
        "default). Point instances at it with --store-master HOST:PORT (config kv_tiers.store_master).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=50051, help="the master's RPC port (default: %(default)s)")
    p.add_argument("--memory-gb", type=float, default=4.0, help="store memory in GiB (default: %(default)s)")
    p.set_defaults(run=run_kv_store)


def run_kv_store(args: argparse.Namespace) -> int:
    argv = ["--host", args.host, "--port", str(args.port), "--memory-gb", str(args.memory_gb)]
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", KV_STORE_MODULE, *argv], child_env())
    return 0  # not reached
