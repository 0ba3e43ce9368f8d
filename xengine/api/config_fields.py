"""The one way config fields are declared: a default and the help text the CLI and the YAML reference
are generated from (``config.py``, ``parallel_config.py``, ``speculative_config.py``, ``xservice/config.py``)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})
