"""The three engine backends the app is built over (one engine process, the supervised engine, the
cluster pool) implement ``EngineBackend``: each member with the Protocol's kind (property, method,
coroutine or async generator) and parameters."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from xservice.cluster.pool import InstancePool
from xservice.engine.client import EngineClient
from xservice.engine.protocol import EngineBackend
from xservice.engine.supervised import SupervisedEngine

IMPLEMENTATIONS = [EngineClient, SupervisedEngine, InstancePool]


def _kind(member: Any) -> str:
    if isinstance(member, property):
        return "property"
    if inspect.isasyncgenfunction(member):
        return "async generator"
    if inspect.iscoroutinefunction(member):
        return "coroutine"
    return "function" if callable(member) else type(member).__name__


def _annotated(cls: type, name: str) -> bool:
    return any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def _params(func: Any) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter but ``self``."""
    params = list(inspect.signature(func).parameters.values())[1:]
    return [(p.name, p.default is not inspect.Parameter.empty) for p in params]


def mismatches(cls: type) -> list[str]:
    """What ``cls`` lacks or does differently from ``EngineBackend``."""
    out = []
    for name, want in vars(EngineBackend).items():
        if name.startswith("_") or not (callable(want) or isinstance(want, property)):
            continue
        try:
            have = inspect.getattr_static(cls, name)
        except AttributeError:
            if not (isinstance(want, property) and _annotated(cls, name)):  # a plain attribute will do
                out.append(f"{name}: missing")
            continue
        wanted = _kind(want)
        if wanted == "function" and name == "generate":
            wanted = "async generator"  # declared as returning an AsyncIterator
        if _kind(have) != wanted:
            out.append(f"{name}: a {_kind(have)}, not a {wanted}")
        elif wanted != "property" and _params(have) != _params(want):
            out.append(f"{name}: parameters {_params(have)}, not {_params(want)}")
    return out


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_engine_backend_implements_the_protocol(cls: type) -> None:
    assert mismatches(cls) == []


def test_the_check_sees_a_missing_member_and_a_wrong_kind() -> None:
    members = {k: v for k, v in vars(SupervisedEngine).items() if k not in ("list_catalogs", "health")}
    members["abort"] = lambda self, req_ids: None  # not a coroutine
    assert mismatches(type("Partial", (), members)) == [
        "health: missing",
        "abort: a function, not a coroutine",
        "list_catalogs: missing",
    ]
