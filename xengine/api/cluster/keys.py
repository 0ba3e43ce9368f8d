"""The metadata store's key layout and the JSON records under it (see docs/cluster.md).

``<prefix>/instances/<name>``  ``InstanceRecord``   written by the engine's agent, under its lease
``<prefix>/load/<name>``       ``LoadReport``       each heartbeat, under the lease
``<prefix>/kv_events/<name>``  ``KVEventBatch``     each heartbeat with KV changes, under the lease
``<prefix>/kv/<name>``         ``KVSnapshot``       the service's persisted global KV index (no lease)
``<prefix>/roles/<name>``      ``RoleRecord``       dynamic PD: the instance's pool and flips (no lease)
``<prefix>/images/<name>``     ``ImageSet``         EPD: content hashes in its image-embedding cache, under the lease

Every record but the instance's own carries the writer's ``incarnation`` (a uuid per engine
process start, and a new one each time the process lost its lease and registers again); readers
drop records whose incarnation is not the registered one.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["prefill", "decode", "mixed", "encode", "encode_prefill", "encode_decode"]
ROLES: tuple[str, ...] = ("prefill", "decode", "mixed", "encode", "encode_prefill", "encode_decode")
# roles that move KV or image embeddings between instances (each runs a Mooncake transfer engine)
TRANSFER_ROLES: tuple[str, ...] = ("prefill", "decode", "encode", "encode_prefill", "encode_decode")
KINDS = ("instances", "load", "kv_events", "kv", "roles", "images")


class InstanceRecord(msgspec.Struct, kw_only=True):
    name: str
    role: Role
    incarnation: str
    input_addr: str  # the engine's PULL socket (the service PUSHes AddRequest ...)
    output_addr: str  # the engine's PUSH socket (the service PULLs deltas)
    pid: int
    info: dict  # msgspec.to_builtins(EngineInfo)
    started_at: float
    # the lease it is registered under: a service that declares the instance dead (no heartbeat seen)
    # revokes it, so the engine learns it was fenced off and comes back as a new incarnation
    lease: int = 0


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
    # raw samples since the previous report, for the service's per-instance performance models (at
    # most ``MAX_SAMPLES`` of each; an even subsample of the drained ones when more ran):
    # per request whose first token came: [uncached_tokens, queue_s, compute_s] (num_prompt_tokens -
    # num_cached_tokens; engine receive -> first scheduled; first scheduled -> first token, >= 0)
    prefills: list[list[float]] = []
    # per non-empty step that ran: [num_seqs, context_tokens, prefill_tokens, step_s] (KV tokens the
    # step's sequences attend once it ran; tokens computed beyond one per decoding sequence; the
    # step's wall time: sync, the whole step; async, from the previous step's completion while busy)
    steps: list[list[float]] = []
    # KV tiers (``docs/kv_tiers.md``): mean milliseconds to load one block from each tier (host, disk,
    # store) so far, and the recent mean prefill compute per uncached prompt token (EWMA): what an L2 /
    # L3 hit saves against recomputing it, for cache-aware routing
    tier_block_load_ms: dict[str, float] = {}
    prefill_token_ms: float | None = None
    lora_adapters: list[str] = []  # LoRA adapters in the instance's device slots: routing prefers them


MAX_SAMPLES = 64  # per kind and LoadReport


class KVEventBatch(msgspec.Struct, kw_only=True):
    """Block hashes stored / removed since the previous batch; ``full``: ``stored`` is the whole set."""

    incarnation: str
    seq: int
    full: bool = False
    stored: list[int] = []
    removed: list[int] = []
    # the same per KV tier behind the prefix cache (host, disk; store: what this instance wrote there);
    # with ``full``, each tier's whole set
    tier_stored: dict[str, list[int]] = {}
    tier_removed: dict[str, list[int]] = {}


class KVSnapshot(msgspec.Struct, kw_only=True):
    incarnation: str
    hashes: list[int] = []


class FlipEntry(msgspec.Struct, kw_only=True):
    at: float  # unix time
    to_role: str
    reason: str


class RoleRecord(msgspec.Struct, kw_only=True):
    """Dynamic PD (``xservice/policies/dynamic_pd.py``): an instance's launch role (``origin``) and the
    role it serves now; written by the service on every flip, read back by a restarted service. Not
    tied to an incarnation: a role belongs to the instance name, across engine restarts."""

    origin: str
    role: str
    num_flips: int = 0
    history: list[FlipEntry] = []  # the most recent flips, oldest first


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


class ImageSet(msgspec.Struct, kw_only=True):
    """The content hashes of the images in an instance's image-embedding cache (EPD routing)."""

    incarnation: str
    seq: int
    hashes: list[str] = []
