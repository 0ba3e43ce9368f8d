"""The metadata store's key layout and the JSON records under it (see docs/cluster.md).

``<prefix>/instances/<name>``  ``InstanceRecord``   written by the engine's agent, under its lease
``<prefix>/load/<name>``       ``LoadReport``       each heartbeat, under the lease
``<prefix>/kv_events/<name>``  ``KVEventBatch``     each heartbeat with KV changes, under the lease
``<prefix>/kv/<name>``         ``KVSnapshot``       the service's persisted global KV index (no lease)

Every record but the instance's own carries the writer's ``incarnation`` (a uuid per engine
process start); readers drop records whose incarnation is not the registered one.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["prefill", "decode", "mixed"]
ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")
KINDS = ("instances", "load", "kv_events", "kv")


class InstanceRecord(msgspec.Struct, kw_only=True):
    name: str
    role: Role
    incarnation: str
    input_addr: str  # the engine's PULL socket (the service PUSHes AddRequest ...)
    output_addr: str  # the engine's PUSH socket (the service PULLs deltas)
    pid: int
    info: dict  # msgspec.to_builtins(EngineInfo)
    started_at: float


class LoadReport(msgspec.Struct, kw_only=True):
    incarnation: str
    seq: int
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    ttft_ms: float | None = None  # recent mean (EWMA) time to first token in the engine
    tpot_ms: float | None = None  # recent mean time per output token
    sent_at: float = 0.0


class KVEventBatch(msgspec.Struct, kw_only=True):
    """Block hashes stored / removed since the previous batch; ``full``: ``stored`` is the whole set."""

    incarnation: str
    seq: int
    full: bool = False
    stored: list[int] = []
    removed: list[int] = []


class KVSnapshot(msgspec.Struct, kw_only=True):
    incarnation: str
    hashes: list[int] = []


def key(prefix: str, kind: str, name: str = "") -> str:
    return f"{prefix.rstrip('/')}/{kind}/{name}"


def parse_key(prefix: str, k: str) -> tuple[str, str] | None:
    """``(kind, name)`` of a key under ``prefix``, or None."""
    rest = k[len(prefix.rstrip("/")) + 1 :] if k.startswith(prefix.rstrip("/") + "/") else None
    if rest is None or "/" not in rest:
        return None
    kind, name = rest.split("/", 1)
    return (kind, name) if kind in KINDS and name else None


def encode(record: msgspec.Struct) -> bytes:
    return msgspec.json.encode(record)


def decode(raw: bytes, cls: type) -> object | None:
    """The record, or None when malformed (a bad writer must not break the registry)."""
    try:
        return msgspec.json.decode(raw, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
