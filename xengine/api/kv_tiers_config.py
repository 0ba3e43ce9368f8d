"""The ``kv_tiers`` section: where prefix-cache blocks go beyond the engine's KV pool (L1).

Torch-free, like ``config.py``, whose ``EngineConfig`` holds it. The engine side is
``xengine/tiered_kv.py`` over ``memory/kv_tiers/``; ``docs/kv_tiers.md`` is the guide."""

from __future__ import annotations

from dataclasses import dataclass

from xengine.api.config_fields import _f

WRITE_POLICIES = ("write_through", "write_back", "selective")
PREFETCH_POLICIES = ("best_effort", "wait", "timeout")


@dataclass(frozen=True)
class KVTiersConfig:
    host_memory_gb: float = _f(
        0.0,
        "L2: host memory for prefix-cache blocks beyond the KV pool, in GiB (pinned on CUDA / NPU; a budget "
        "of its own on CPU). 0: no host tier.",
    )
    disk_path: str = _f(
        "",
        "L3 on local disk: a file (one arena of checksummed block slots) for prefix-cache blocks; a restarted "
        "instance finds what its last run stored. One file per engine process (data-parallel ranks add "
        ".dp<rank>). Empty: no disk tier.",
    )
    disk_gb: float = _f(4.0, "Size of the disk tier's file, in GiB.")
    store_master: str = _f(
        "",
        "L3 across instances: host:port of a mooncake_master (`xllm kv-store` starts one with the memory "
        "behind it, on loopback), or auto: xllm serve starts one for its instances (store_memory_gb). "
        "Instances of the same model and KV layout share prefixes through it, and a request migrated off a "
        "dead instance loads its prompt from it. Empty: no store tier.",
    )
    store_memory_gb: float = _f(4.0, "store_master auto: memory of the KV store the service starts, in GiB.")
    store_host: str = _f(
        "127.0.0.1",
        "Address this instance's Mooncake Store client listens on (its transfer engine; kept there by the "
        "bind shim). Loopback unless the store's memory is on other hosts.",
    )
    write_policy: str = _f(
        "write_through",
        "write_through: a block goes to every tier as soon as the prefix cache holds it (what failover and "
        "other instances need); write_back: to L2 when the KV pool evicts it, to L3 when L2 evicts it (least "
        "traffic); selective: write-through for blocks hit at least write_min_hits times.",
    )
    write_min_hits: int = _f(2, "selective: prefix hits a block needs before it is written to the tiers.")
    prefetch_policy: str = _f(
        "timeout",
        "A waiting request whose prompt the tiers hold beyond the KV pool: wait (admitted once its blocks are "
        "loaded), timeout (wait at most prefetch_timeout_s, then compute what has not arrived) or best_effort "
        "(never wait: use what has arrived when it is admitted).",
    )
    prefetch_timeout_s: float = _f(
        5.0, "prefetch_policy timeout: the longest a request waits for its blocks."
    )
    window_checkpoint_tokens: int = _f(
        0,
        "Sliding-window models: the tiers keep the window blocks a resume needs each this many tokens of a "
        "sequence (and where it ends); a prompt sharing a prefix resumes from the last such point in it. "
        "0: twice the window (at most half the window layers' KV is stored); the window itself: all of it.",
    )

    @property
    def enabled(self) -> bool:
        return self.host_memory_gb > 0 or bool(self.disk_path) or bool(self.store_master)

    def validate(self) -> None:
        if self.host_memory_gb < 0:
            raise ValueError("kv_tiers.host_memory_gb must be >= 0")
        if self.disk_path and self.disk_gb <= 0:
            raise ValueError("kv_tiers.disk_gb must be > 0 with kv_tiers.disk_path")
        master = self.store_master
        if master and master != "auto" and (":" not in master or not master.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"kv_tiers.store_master must be host:port or auto, got {master!r}")
        if self.store_memory_gb <= 0:
            raise ValueError("kv_tiers.store_memory_gb must be > 0")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"kv_tiers.write_policy must be one of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}"
            )
        if self.write_min_hits < 1:
            raise ValueError("kv_tiers.write_min_hits must be >= 1")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"kv_tiers.prefetch_policy must be one of {', '.join(PREFETCH_POLICIES)}, "
                f"got {self.prefetch_policy!r}"
            )
        if self.prefetch_timeout_s <= 0:
            raise ValueError("kv_tiers.prefetch_timeout_s must be > 0")
        if self.window_checkpoint_tokens < 0:
            raise ValueError("kv_tiers.window_checkpoint_tokens must be >= 0 (0: twice the window)")
