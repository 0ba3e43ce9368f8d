"""``--smoke``: a seconds-long run of a benchmark program with the smallest sizes, on the tiny model.

It shows that the program still runs end to end after a refactor (``tests/benchmarks/
test_every_benchmark.py`` runs each program's ``--smoke``); its numbers mean nothing. A program names
its smoke sizes once, as replacement defaults, so flags given beside ``--smoke`` still win.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

SMOKE_HELP = "a seconds-long run with the smallest sizes: checks the program runs, its numbers mean nothing"


def add_smoke_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--smoke`` to a benchmark's parser."""
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def parse_args(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, smoke: Mapping[str, Any]
) -> argparse.Namespace:
    """``p.parse_args(argv)``; with ``--smoke``, ``smoke`` (argument dest -> value) replaces the
    defaults first, so explicitly given flags still win. A key that is no argument of ``p`` raises."""
    args = p.parse_args(argv)
    unknown = sorted(set(smoke) - set(vars(args)))
    if unknown:
        raise ValueError(f"smoke settings for arguments the parser does not have: {unknown}")
    if args.smoke:
        p.set_defaults(**smoke)
        args = p.parse_args(argv)
    return args
