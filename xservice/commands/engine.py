"""``xllm engine``: one standalone engine instance that registers in etcd and outlives any service.

``xllm engine --config FILE --name NAME --role {mixed,prefill,decode} [--model DIR] [--port P]``

Becomes (exec) ``python -m xengine.process.engine_server``, with no parent-death link: it binds
its ZMQ sockets on ``cluster.launch.engine_host`` (free ports, or ``--port`` and ``--port + 1``),
registers under a lease in the etcd of ``cluster.registry.etcd_endpoint`` / ``cluster.registry.key_prefix`` and
serves whichever service connects (``xllm serve`` with ``cluster.launch.launcher: external``). When a
new service connects (the previous one died or was restarted), the requests of the previous one
are aborted. SIGTERM / Ctrl-C drains running requests and deregisters.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from typing import Any

from xengine.api.entrypoints import ENGINE_SERVER_MODULE
from xengine.api.paths import default_cluster_key_file
from xengine.api.security import load_or_create_key_file
from xservice.commands.common import CliError, load_cli_config, resolve_model
from xservice.engine.process import child_env

ROLES = ("mixed", "prefill", "decode", "encode", "encode_prefill", "encode_decode")
STORE_CHECK_TIMEOUT_S = 5.0


def register_engine(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "engine",
        help="run one standalone engine instance registered in etcd (cluster mode)",
        description="Run one engine instance that registers in etcd (config section 'cluster': "
        "etcd_endpoint, key_prefix, engine_host, lease_ttl_s, heartbeat_interval_s) and serves the "
        "service that connects to it ('xllm serve' with cluster.launch.launcher: external). It outlives the "
        "service: a restarted service finds it in etcd again.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (engine sections and 'cluster').")
    p.add_argument("--name", required=True, help="instance name, unique in the cluster (no '/')")
    p.add_argument("--role", choices=ROLES, default="mixed", help="instance role (default: %(default)s)")
    p.add_argument(
        "--model", dest="cfg__model__model", metavar="DIR", default=None, help="model folder [model.model]"
    )
    p.add_argument("--port", type=int, default=0, help="input port (output: port + 1); default: free ports")
    p.set_defaults(run=run_engine)


def run_engine(args: argparse.Namespace) -> int:
    cfg = resolve_model(load_cli_config(args))
    cl = cfg.cluster
    if not args.name or "/" in args.name:
        raise CliError("--name must be non-empty and contain no '/'")
    if cl.registry.store != "etcd":
        raise CliError(
            "xllm engine needs cluster.registry.store: etcd (the embedded store lives in a service, so a "
            "standalone engine could not outlive it); set it in the config file"
        )
    if not 0 <= args.port < 65535:
        raise CliError("--port must be in [0, 65534] (the output socket uses port + 1)")
    _check_store(cl.registry.etcd_endpoint)
    print(
        f"xllm: engine {args.name} ({args.role}) for {cfg.model.model}, "
        f"registering in etcd://{cl.registry.etcd_endpoint}{cl.registry.key_prefix}",
        file=sys.stderr,
        flush=True,
    )
    # The engine runs torch: this process becomes it (exec), so the CLI itself never imports the engine.
    server_args = [
        "--config-json", json.dumps(dataclasses.asdict(cfg.engine)),
        "--name", args.name,
        "--role", args.role,
        "--store", cl.registry.store_url,
        "--key-prefix", cl.registry.key_prefix,
        "--host", cl.launch.engine_host,
        "--port", str(args.port),
        "--lease-ttl-s", str(cl.registry.lease_ttl_s),
        "--heartbeat-interval-s", str(cl.registry.heartbeat_interval_s),
    ]  # fmt: skip
    if cl.launch.engine_nice:
        server_args += ["--nice", str(cl.launch.engine_nice)]
    if cl.auth.enabled:  # the key file the attaching service reads too (created here on first use)
        key_file = cl.auth.key_file or str(default_cluster_key_file())
        try:
            load_or_create_key_file(key_file)
        except (OSError, ValueError) as e:
            raise CliError(f"cluster key: {e}") from e
        server_args += ["--auth-key-file", key_file]
    else:
        server_args.append("--no-auth")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", ENGINE_SERVER_MODULE, *server_args], child_env())


def _check_store(endpoint: str) -> None:
    """Fail fast (instead of retrying forever) when etcd is not reachable at startup."""
    from xengine.api.cluster.store import StoreUnavailableError
    from xengine.api.cluster.store.etcd import EtcdStore

    async def check() -> None:
        host, _, port = endpoint.rpartition(":")
        store = EtcdStore(host or "127.0.0.1", int(port))
        try:
            await asyncio.wait_for(store.get("/"), STORE_CHECK_TIMEOUT_S)
        finally:
            await store.close()

    try:
        asyncio.run(check())
    except (StoreUnavailableError, TimeoutError, asyncio.TimeoutError, ValueError) as e:
        raise CliError(
            f"etcd not reachable at {endpoint} ({e}); "
            "start one (ci/etcd.sh start) or fix cluster.registry.etcd_endpoint"
        ) from e
