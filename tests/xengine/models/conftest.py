"""Session fixtures for the model tests: tiny checkpoints built once (see ``helpers.VARIANTS``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.xengine.models.helpers import build_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory ``name -> folder`` of a tiny checkpoint (see ``VARIANTS``), cached per session."""
    cache: dict[str, Path] = {}

    def _get(name: str) -> Path:
        if name not in cache:
            cache[name] = build_checkpoint(name, tmp_path_factory.mktemp(f"ckpt-{name}"))
        return cache[name]

    return _get
