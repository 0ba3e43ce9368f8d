"""What every ``xllm`` subcommand shares: ``CliError``, config flags, the model and tokenizer, the socket.

User errors raise ``CliError``: one line on stderr, exit code 2, no traceback. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from xengine.api.config import replace_section
from xengine.api.paths import default_model_dir
from xservice.config import XllmConfig, load_config

EXIT_USAGE = 2
_METAVARS = {int: "N", float: "X"}


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


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


def resolve_model(cfg: XllmConfig) -> XllmConfig:
    """Check the model folder, or fall back to the embedded default model (built on first use)."""
    if not cfg.model.model:
        if not (default_model_dir() / "config.json").is_file():
            print(f"xllm: building the embedded default model into {default_model_dir()} (first use only)")
            # in a child process: the service itself never imports torch
            code = "from xengine.tools.make_tiny import ensure_default_model; ensure_default_model(progress=True)"
            if subprocess.run([sys.executable, "-c", code]).returncode != 0:
                raise CliError("building the default model failed (see above); pass --model DIR instead")
        return replace_section(cfg, "model", model=str(default_model_dir()))
    folder = Path(cfg.model.model).expanduser()
    if not (folder / "config.json").is_file():
        raise CliError(
            f"model folder {str(folder)!r} not found or has no config.json; pass --model DIR with a local "
            "Hugging Face folder (config.json, *.safetensors, tokenizer.json), or omit it for the default model"
        )
    return replace_section(cfg, "model", model=str(folder.resolve()))


def load_tokenizer(model_dir: str) -> Any:
    from xengine.api.text.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(model_dir)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot load the tokenizer of {model_dir!r}: {e}") from e


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
