"""The ``xllm`` command line: ``serve``, ``chat``, ``model make-tiny``, ``batch``, ``run-batch``, ``engine``,
``cluster status``, ``profile epd``, ``plan prfaas``.

Each subcommand lives in ``xservice/commands/`` as a ``register(subparsers)`` function that adds its
parser and sets ``run=<function(args) -> int>``; add new ones to ``COMMANDS``. User errors raise
``CliError`` (``xservice/commands/common.py``): one line on stderr, exit code 2, no traceback.
Heavy imports happen inside the commands so ``xllm --help`` stays fast (and torch-free).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from xservice.commands.batch import register_batch, register_run_batch
from xservice.commands.chat import register_chat
from xservice.commands.cluster import register_cluster
from xservice.commands.common import EXIT_USAGE, CliError, load_cli_config
from xservice.commands.engine import register_engine
from xservice.commands.kv_store import register_kv_store
from xservice.commands.model import register_model
from xservice.commands.plan import register_plan
from xservice.commands.profile import register_profile
from xservice.commands.serve import register_serve

COMMANDS: tuple[Callable[[Any], None], ...] = (
    register_serve,
    register_chat,
    register_model,
    register_batch,
    register_run_batch,
    register_engine,
    register_cluster,
    register_kv_store,
    register_profile,
    register_plan,
)

__all__ = ["COMMANDS", "CliError", "build_parser", "load_cli_config", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``xllm`` and ``python -m xservice``."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what ``xllm serve``'s watchdog runs its server with
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
