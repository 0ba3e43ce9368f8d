"""The ``xllm`` command line: ``serve``, ``chat``, ``model make-tiny``, ``batch``, ``engine``.

Each subcommand is a ``register(subparsers)`` function that adds its parser and sets
``run=<function(args) -> int>``; add new ones to ``COMMANDS``. User errors raise ``CliError``:
one line on stderr, exit code 2, no traceback. Heavy imports happen inside the commands so
``xllm --help`` stays fast (and torch-free).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import socket
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xservice.config import XllmConfig, load_config

EXIT_USAGE = 2
_METAVARS = {int: "N", float: "X"}
ENGINE_WATCH_INTERVAL_S = 0.5


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``xllm`` and ``python -m xservice``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except CliError as e:
        print(f"xllm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xllm", description="xllm: OpenAI-compatible LLM serving.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in COMMANDS:
        register(subparsers)
    return parser


# ---------------------------------------------------------------------- config flags


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (``--block-size`` for ``cache.block_size``), help from the field.

    Booleans that default to true get ``--no-<name>`` (``enable_`` dropped), others ``--<name>``.
    Every flag defaults to None, meaning "keep the config file's value".
    """
    sections = typing.get_type_hints(XllmConfig)
    for section in (f.name for f in dataclasses.fields(XllmConfig)):
        cls = sections[section]
        group = parser.add_argument_group(f"{section} (config section '{section}')")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field_flag(group, section, f, hints[f.name])


def _add_field_flag(group: Any, section: str, f: dataclasses.Field, hint: Any) -> None:
    dest = f"cfg__{section}__{f.name}"
    doc = f.metadata.get("help", "").replace("%", "%%")
    default = "unset" if f.default in (None, "") else f.default
    where = f"[{section}.{f.name}; default: {default}]"
    name = f.name.replace("_", "-")
    if hint is bool:
        if f.default:
            flag, value, help_text = "--no-" + name.removeprefix("enable-"), False, f"Turn off: {doc} {where}"
        else:
            flag, value, help_text = "--" + name, True, f"{doc} {where}"
        group.add_argument(flag, dest=dest, action="store_const", const=value, default=None, help=help_text)
        return
    kind = ([t for t in typing.get_args(hint) if t is not type(None)] or [hint])[0]
    metavar = _METAVARS.get(kind, name.upper())
    group.add_argument(
        f"--{name}", dest=dest, type=kind, default=None, metavar=metavar, help=f"{doc} {where}"
    )


def config_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The config flags that were given, as ``{section: {field: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            _, section, name = key.split("__", 2)
            out.setdefault(section, {})[name] = value
    return out


def load_cli_config(args: argparse.Namespace) -> XllmConfig:
    """``--config FILE`` overridden by flags; user errors become ``CliError``."""
    import yaml

    if args.config is not None and not Path(args.config).is_file():
        raise CliError(f"config file not found: {args.config}")
    try:
        return load_config(args.config, config_overrides(args))
    except yaml.YAMLError as e:
        raise CliError(f"{args.config}: invalid YAML: {' '.join(str(e).split())}") from e
    except (ValueError, TypeError) as e:
        raise CliError(f"{e} (fix the config file or the flag)") from e


# ---------------------------------------------------------------------- serve


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
    sock = bind_socket(cfg.service.host, cfg.service.port)
    return asyncio.run(serve(cfg, sock))


def resolve_model(cfg: XllmConfig) -> XllmConfig:
    """Check the model folder, or fall back to the embedded default model (built on first use)."""
    from xengine.config import replace_section

    if not cfg.model.model:
        from xengine.tools.make_tiny import default_model_dir, ensure_default_model

        if not (default_model_dir() / "config.json").is_file():
            print(f"xllm: building the embedded default model into {default_model_dir()} (first use only)")
            # in a child process: the service itself never imports torch
            code = "from xengine.tools.make_tiny import ensure_default_model; ensure_default_model(progress=True)"
            if subprocess.run([sys.executable, "-c", code]).returncode != 0:
                raise CliError("building the default model failed (see above); pass --model DIR instead")
        return replace_section(cfg, "model", model=str(ensure_default_model(progress=False)))
    folder = Path(cfg.model.model).expanduser()
    if not (folder / "config.json").is_file():
        raise CliError(
            f"model folder {str(folder)!r} not found or has no config.json; pass --model DIR with a local "
            "Hugging Face folder (config.json, *.safetensors, tokenizer.json), or omit it for the default model"
        )
    return replace_section(cfg, "model", model=str(folder.resolve()))


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket up front, so a busy port fails before the engine starts."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise CliError(f"cannot use host {host!r}: {e}; pass --host with a local address") from e
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise CliError(
            f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or stop the other server"
        ) from e
    return sock  # uvicorn starts listening once the engine is ready


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
    from xservice.engine_client import EngineClient, EngineStartupError

    phases = _SignalPhases()
    client = None
    try:
        tokenizer = load_tokenizer(cfg.model.model)
        if cfg.cluster.enabled:
            from xservice.cluster.serve import serve_cluster

            return await serve_cluster(cfg, sock, tokenizer, _serve_http, phases)
        print(f"xllm: starting the engine for {cfg.model.model}", file=sys.stderr, flush=True)
        try:
            client = await EngineClient.start(cfg.engine, cfg.service.engine_startup_timeout_s)
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
        phases.restore()
        sock.close()


def load_tokenizer(model_dir: str) -> Any:
    from xengine.text.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(model_dir)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot load the tokenizer of {model_dir!r}: {e}") from e


async def _serve_http(cfg: XllmConfig, sock: socket.socket, client: Any, tokenizer: Any, phases: Any) -> int:
    import uvicorn

    from xservice.app import build_app

    app = build_app(client, tokenizer, cfg)
    config = uvicorn.Config(app, log_level=cfg.service.log_level, timeout_graceful_shutdown=10)
    server = phases.server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"xllm serving {client.info.model_name} at http://{host}:{port}/v1", flush=True)
    # If the engine dies the service stays up: readiness fails and requests get 503 with
    # Retry-After, so a supervisor or load balancer sees it instead of connection errors.
    engine_died = False
    while not serving.done():
        await asyncio.wait([serving], timeout=ENGINE_WATCH_INTERVAL_S)
        if not client.is_alive and not engine_died:
            print("xllm: error: the engine process died; answering 503 until restarted", file=sys.stderr)
            engine_died = True
    await serving
    return 1 if engine_died else 0


# ---------------------------------------------------------------------- model tools


def register_model(subparsers: Any) -> None:
    from xengine.tools.make_tiny import ARCHS, SIZES

    p = subparsers.add_parser("model", help="model tools (make-tiny)", description="Model tools.")
    tools = p.add_subparsers(title="model commands", metavar="COMMAND")
    tiny = tools.add_parser(
        "make-tiny",
        help="write a small seeded-random checkpoint of a real architecture",
        description="Write a small seeded-random checkpoint (safetensors + tokenizer) into --out.",
    )
    tiny.add_argument("--arch", choices=ARCHS, default="qwen3", help="model architecture")
    tiny.add_argument("--size", choices=SIZES, default="tiny", help="tiny (~1M params) or small (~56M)")
    tiny.add_argument("--out", required=True, help="output folder")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokenizer corpus")
    tiny.add_argument("--quiet", action="store_true", help="no progress output")
    tiny.set_defaults(run=run_make_tiny)
    p.set_defaults(run=lambda _args: (p.print_help(sys.stderr), EXIT_USAGE)[1])


def run_make_tiny(args: argparse.Namespace) -> int:
    from xengine.tools.make_tiny import main as make_tiny_main

    argv = ["--arch", args.arch, "--size", args.size, "--out", args.out, "--seed", str(args.seed)]
    return make_tiny_main(argv + (["--quiet"] if args.quiet else []))


# ---------------------------------------------------------------------- chat


def register_chat(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat with a running server in the terminal",
        description="Terminal chat against a running xllm (or any OpenAI-compatible) server. "
        "Type /reset to clear the history, /exit or Ctrl-D to quit.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="server base URL (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="API key, if the server requires one")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default: %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature (default: %(default)s)"
    )
    p.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/") + "/"
    with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(600.0, connect=5.0)) as http:
        try:
            model = args.model or _first_model(http)
        except httpx.HTTPError as e:
            raise CliError(
                f"cannot reach {args.url} ({e}); start a server with 'xllm serve' or pass --url"
            ) from e
        history = [{"role": "system", "content": args.system}] if args.system else []
        print(f"chatting with {model} at {args.url} (/reset clears the history, /exit quits)")
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                history = history[:1] if args.system else []
                continue
            if line:
                history.append({"role": "user", "content": line})
                reply = _stream_reply(http, model, history, args)
                if reply is None:
                    history.pop()  # the turn failed: forget it
                else:
                    history.append({"role": "assistant", "content": reply})


def _first_model(http: Any) -> str:
    resp = http.get("models")
    if resp.status_code != 200:
        raise CliError(f"GET {resp.url} answered {resp.status_code}: {_error_message(resp.text)}")
    data = resp.json().get("data") or []
    if not data:
        raise CliError("the server lists no models; pass --model")
    return data[0]["id"]


def _stream_reply(http: Any, model: str, history: list[dict], args: argparse.Namespace) -> str | None:
    """Stream one reply to stdout; returns its text, or None when the server refused."""
    body = {
        "model": model,
        "messages": history,
        "stream": True,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    parts: list[str] = []
    print("assistant> ", end="", flush=True)
    with http.stream("POST", "chat/completions", json=body) as resp:
        if resp.status_code != 200:
            print(f"[error {resp.status_code}: {_error_message(resp.read().decode())}]")
            return None
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            _print_chunk(json.loads(payload), parts.append)
    print()
    return "".join(parts)


def _print_chunk(chunk: dict, keep: Callable[[str], None]) -> None:
    if "error" in chunk:
        print(f"[error: {_error_message(json.dumps(chunk))}]", end="")
        return
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            print(text, end="", flush=True)
            keep(text)


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]


from xservice.commands.batch import register_batch, register_run_batch  # noqa: E402  (imports this module lazily)
from xservice.commands.engine import register_engine  # noqa: E402  (imports this module lazily)

COMMANDS: tuple[Callable[[Any], None], ...] = (
    register_serve,
    register_chat,
    register_model,
    register_batch,
    register_run_batch,
    register_engine,
)
