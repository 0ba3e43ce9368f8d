"""``xllm serve``: the OpenAI API over one engine (single node) or a cluster of instances."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from xservice.commands.common import (
    CliError,
    add_config_flags,
    bind_socket,
    load_cli_config,
    load_tokenizer,
    resolve_model,
)
from xservice.config import XllmConfig

if TYPE_CHECKING:
    from xservice.engine.protocol import EngineBackend


def register_serve(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a local Hugging Face model folder (default: the embedded default model) over the "
        "OpenAI API. Flags override the config file.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (sections: service, model, ...).")
    add_config_flags(p)
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    cfg = resolve_model(load_cli_config(args))
    level = cfg.service.log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise CliError(
            f"service.log_level must be debug, info, warning or error, got {cfg.service.log_level!r}"
        )
    logging.basicConfig(level=level, format="%(asctime)s xservice %(levelname)s %(name)s: %(message)s")
    from xservice.http.watchdog import inherited_socket, run_watchdog

    sock = inherited_socket()  # set when this process is a watchdog's server
    if sock is None:
        sock = bind_socket(cfg.service.host, cfg.service.port)
        if cfg.service.watchdog:
            return run_watchdog(args.argv, sock, cfg.service.restart_policy())
    return asyncio.run(serve(cfg, sock))


class _SignalPhases:
    """SIGINT/SIGTERM handling around uvicorn (which handles them while it serves).

    Before serving, a signal cancels startup; afterwards (uvicorn re-raises the signal it caught)
    it only asks the server to stop, so the engine is still closed gracefully.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.server: Any = None
        self.closing = False
        self.saved = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.closing:
            return
        if self.server is not None:
            self.server.should_exit = True
        elif self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)

    def restore(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


async def serve(cfg: XllmConfig, sock: socket.socket) -> int:
    """Start the engine, serve HTTP on ``sock`` until a signal, then stop both gracefully."""
    from xservice.engine.errors import EngineStartupError
    from xservice.engine.supervised import SupervisedEngine
    from xservice.kv_store_process import start_auto_store

    phases = _SignalPhases()
    client = store = None
    try:
        tokenizer = load_tokenizer(cfg.model.model)
        try:  # kv_tiers.store_master auto: the KV store first (docs/kv_tiers.md)
            cfg, store = await start_auto_store(cfg)
        except RuntimeError as e:
            raise CliError(str(e)) from e
        if cfg.cluster.enabled:
            from xengine.api.cluster.store import StoreUnavailableError
            from xengine.api.security import ClusterKeyError
            from xservice.cluster.epd.auto import EPDAutoError
            from xservice.cluster.serve import serve_cluster

            try:
                return await serve_cluster(cfg, sock, tokenizer, _serve_http, phases)
            except (StoreUnavailableError, ClusterKeyError, EPDAutoError) as e:
                raise CliError(str(e)) from e
        print(f"xllm: starting the engine for {cfg.model.model}", file=sys.stderr, flush=True)
        try:
            svc = cfg.service
            client = await SupervisedEngine.start(
                cfg.engine, svc.restart_policy(), svc.engine_startup_timeout_s, svc.engine_hang_timeout_s
            )
        except EngineStartupError as e:
            raise CliError(f"the engine did not start: {str(e).splitlines()[0]} (see the log above)") from e
        return await _serve_http(cfg, sock, client, tokenizer, phases)
    except asyncio.CancelledError:
        print("xllm: interrupted", file=sys.stderr)
        return 130
    finally:
        phases.closing = True
        if client is not None:
            await client.close()
        if store is not None:
            store.stop()
        phases.restore()
        sock.close()


async def _serve_http(
    cfg: XllmConfig, sock: socket.socket, client: EngineBackend, tokenizer: Any, phases: Any
) -> int:
    import uvicorn

    from xservice.http.app import build_app

    app = build_app(client, tokenizer, cfg)
    config = uvicorn.Config(
        app,
        log_level=cfg.service.log_level,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=cfg.service.keep_alive_s,
    )
    server = phases.server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"xllm serving {client.info.model_name} at http://{host}:{port}/v1", flush=True)
    # A dead engine is restarted by its supervisor; meanwhile requests get 503 with Retry-After and
    # /health fails. Should the supervisor give up, /health/live fails too and the exit code is 1.
    await serving
    return 1 if client.health == "failed" else 0
