"""No import circle in ``ops``, ``memory`` or ``graph``, counting every import a reader follows: those
inside functions and those of a package's ``__init__`` (the layering test leaves the latter out, and
``ops/moe.py -> ops/registry.py -> ops/torch_ref/__init__.py -> ops/torch_ref/moe.py -> ops/moe.py``
hid there)."""

from __future__ import annotations

from graphlib import CycleError, TopologicalSorter

import pytest

from tests.test_layering import _graph

PACKAGES = ("ops", "memory", "graph")


def _mine(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def test_ops_memory_and_graph_have_no_import_cycle() -> None:
    graph = {m: {d for d in targets if _mine(d)} for m, targets in _graph().items() if _mine(m)}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")
