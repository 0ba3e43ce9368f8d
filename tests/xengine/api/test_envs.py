"""``xengine/api/envs.py``: the one place the ``XLLM_*`` environment variables are named, read when
asked (so a test or a parent may set them at any time), and documented in ``docs/operations.md``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_layering import ENVS, _violations
from xengine.api import envs
from xengine.api.paths import cache_dir

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("xservice", "xengine", "memory", "graph", "ops")
NAME = re.compile(r"XLLM_[A-Z0-9_]+")


def _named_outside_envs() -> list[str]:
    """``file: XLLM_X`` for each string constant that is exactly a variable's name, outside envs.py."""
    out = []
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "xengine" / "api" / "envs.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and NAME.fullmatch(node.value)
                ):
                    out.append(f"{path.relative_to(ROOT)}: {node.value}")
    return out


def test_no_product_module_names_a_variable_but_envs() -> None:
    assert _named_outside_envs() == []


def test_each_variable_is_declared_once_and_documented() -> None:
    names = [v.name for v in envs.ALL]
    assert len(set(names)) == len(names) and all(NAME.fullmatch(n) for n in names)
    declared = {v.name for v in vars(envs).values() if isinstance(v, envs.EnvVar)}
    assert declared == set(names)
    doc = (ROOT / "docs" / "operations.md").read_text()
    for var in envs.ALL:
        assert f"`{var.name}`" in doc, var.name


def test_values_are_read_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XLLM_CPU_KERNELS", raising=False)
    assert envs.CPU_KERNELS.get() == "auto"
    monkeypatch.setenv("XLLM_CPU_KERNELS", "off")
    assert envs.CPU_KERNELS.get() == "off" and envs.CPU_KERNELS.get({}) == "auto"
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path == envs.cache_dir()
    monkeypatch.setenv("XLLM_CLUSTER_KEY", "secret")
    assert envs.CLUSTER_KEY.pop() == "secret" and envs.CLUSTER_KEY.get() == ""


def test_ops_and_memory_may_import_this_module_and_nothing_else_of_the_engine() -> None:
    """The narrow exception of ``tests/test_layering.py``: ops and memory may read variables here; this
    module imports nothing of the project."""
    graph = {
        "ops.platforms": {ENVS, "xengine.api.paths"},
        "memory.bind_host": {ENVS, "ops.native_build"},
        ENVS: {"xengine.api.paths"},
    }
    assert _violations(graph) == [
        "ops.platforms -> xengine.api.paths: ops imports no other package",
        f"{ENVS} -> xengine.api.paths: a leaf of the contract imports nothing of the project",
    ]
