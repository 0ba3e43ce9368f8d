"""What every ``xllm`` subcommand shares: ``CliError``, config flags, the model and tokenizer, the socket.

User errors raise ``CliError``: one line on stderr, exit code 2, no traceback. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

from xengine.api.config import replace_section
from xengine.api.paths import default_model_dir
from xservice.cluster.config_legacy import FLAT_KEYS, FLAT_SWITCHES, section_types
from xservice.config import XllmConfig, load_config

EXIT_USAGE = 2
_METAVARS = {int: "N", float: "X"}


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (``--block-size`` for ``cache.block_size``), help from the field.

    Booleans that default to true get ``--no-<name>`` (``enable_`` dropped), others ``--<name>``.
    ``cluster``'s sub-sections give ``--<section>-<field>`` (``--pd-mode`` for ``cluster.pd.mode``; an
    ``enabled`` field is ``--<section>``), and the former flat key's flag (``--routing-policy`` for
    ``cluster.routing.policy``) stays as an alias. Every flag defaults to None: "keep the config file's value".
    """
    sections = typing.get_type_hints(XllmConfig)
    for section in (f.name for f in dataclasses.fields(XllmConfig)):
        if section == "cluster":
            _add_cluster_flags(parser)
            continue
        if section == "speculative_config":  # vLLM's one JSON flag, not a flag per key
            parser.add_argument(
                "--speculative-config",
                dest="speculative_config_json",
                type=_json_mapping,
                default=None,
                metavar="JSON",
                help="Speculative decoding as one JSON object with the keys of the config section "
                '\'speculative_config\', e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'.',
            )
            continue
        cls = sections[section]
        group = parser.add_argument_group(f"{section} (config section '{section}')")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field_flag(group, (section,), f, hints[f.name])


def _add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    former = {new: old for old, new in FLAT_KEYS.items()}
    former.update({(section, "enabled"): old for old, section in FLAT_SWITCHES.items()})
    for sub, cls in section_types().items():
        group = parser.add_argument_group(f"cluster.{sub} (config section 'cluster.{sub}')")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            alias = former.get((sub, f.name))
            _add_field_flag(group, ("cluster", sub), f, hints[f.name], alias)


def _add_field_flag(
    group: Any, path: tuple[str, ...], f: dataclasses.Field, hint: Any, alias: str | None = None
) -> None:
    dest = "cfg__" + "__".join((*path, f.name))
    doc = f.metadata.get("help", "").replace("%", "%%")
    default = "unset" if f.default in (None, "") else f.default
    where = f"[{'.'.join((*path, f.name))}; default: {default}]"
    names = [f.name if len(path) == 1 else path[-1] if f.name == "enabled" else f"{path[-1]}_{f.name}"]
    names += [alias] if alias and alias not in names else []
    names = [n.replace("_", "-") for n in names]
    if hint is bool:
        if f.default:
            flags, value, help_text = (
                ["--no-" + n.removeprefix("enable-") for n in names],
                False,
                f"Turn off: {doc}",
            )
        else:
            flags, value, help_text = ["--" + n for n in names], True, doc
        group.add_argument(
            *flags, dest=dest, action="store_const", const=value, default=None, help=f"{help_text} {where}"
        )
        return
    if typing.get_origin(hint) is tuple:  # a list of values: ``--lora-modules a=/p b=/q`` (as vLLM)
        group.add_argument(
            *[f"--{n}" for n in names],
            dest=dest,
            nargs="+",
            default=None,
            metavar="VALUE",
            help=f"{doc} {where}",
        )
        return
    kind = ([t for t in typing.get_args(hint) if t is not type(None)] or [hint])[0]
    metavar = _METAVARS.get(kind, f.name.replace("_", "-").upper())
    group.add_argument(
        *[f"--{n}" for n in names], dest=dest, type=kind, default=None, metavar=metavar, help=f"{doc} {where}"
    )


def _json_mapping(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"method": "ngram"}\'')
    return value


def config_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The config flags that were given, as ``{section: {field: value}}`` (``cluster``: ``{sub: {...}}``)."""
    out: dict[str, dict[str, Any]] = {}
    spec = getattr(args, "speculative_config_json", None)
    if spec is not None:
        out["speculative_config"] = dict(spec)
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            _, section, *path = key.split("__")
            target = out.setdefault(section, {})
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = value
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
