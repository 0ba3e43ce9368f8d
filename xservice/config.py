"""Service configuration and the top-level config file (``xllm serve --config FILE``).

A YAML file maps 1:1 onto ``XllmConfig``: sections ``service``, ``model``, ``cache``,
``scheduler``, ``device``, ``batch``. Unknown keys are an error. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from xengine.api.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    _f,
    from_dict,
)
from xservice.cluster.config import ClusterConfig


@dataclass(frozen=True)
class ServiceConfig:
    host: str = _f("127.0.0.1", "Address to bind the HTTP server to (loopback by default).")
    port: int = _f(8000, "HTTP port.")
    api_key: str | None = _f(None, "If set, every route but /health* requires 'Authorization: Bearer <key>'.")
    max_body_bytes: int = _f(4 * 1024 * 1024, "Largest accepted request body; larger bodies get 413.")
    max_pending_requests: int = _f(512, "Requests in flight (running + waiting) before new ones get 429.")
    max_n: int = _f(16, "Largest 'n' accepted over HTTP.")
    engine_startup_timeout_s: float = _f(900.0, "How long to wait for the engine process to become ready.")
    log_level: str = _f("info", "Log level: debug, info, warning, error.")

    def validate(self) -> None:
        if not (0 <= self.port < 65536):
            raise ValueError("service.port must be in [0, 65535]")
        if self.max_body_bytes < 1024:
            raise ValueError("service.max_body_bytes must be >= 1024")
        if self.max_pending_requests < 1:
            raise ValueError("service.max_pending_requests must be >= 1")


@dataclass(frozen=True)
class BatchConfig:
    data_dir: str = _f(
        "",
        "Folder of the batch job store (SQLite + files); default: $XLLM_CACHE_DIR/batch or ~/.cache/xllm/batch.",
    )
    max_file_bytes: int = _f(100 * 1024 * 1024, "Largest file accepted by POST /v1/files; larger get 413.")
    max_concurrent_lines: int = _f(
        32,
        "Batch lines in flight at once, as 'offline' requests (at most half of service.max_pending_requests).",
    )

    @property
    def resolved_data_dir(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return Path(os.environ.get("XLLM_CACHE_DIR") or Path.home() / ".cache" / "xllm") / "batch"

    def validate(self) -> None:
        if self.max_file_bytes < 1024:
            raise ValueError("batch.max_file_bytes must be >= 1024")
        if self.max_concurrent_lines < 1:
            raise ValueError("batch.max_concurrent_lines must be >= 1")


@dataclass(frozen=True)
class XllmConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(model=self.model, cache=self.cache, scheduler=self.scheduler, device=self.device)

    def validate(self) -> None:
        self.service.validate()
        self.engine.validate()
        self.batch.validate()
        self.cluster.validate()


_SECTIONS = {
    "service": ServiceConfig,
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "batch": BatchConfig,
    "cluster": ClusterConfig,
}


def load_config(path: str | Path | None, overrides: dict[str, dict[str, Any]] | None = None) -> XllmConfig:
    """Read a YAML config (or defaults when ``path`` is None) and apply per-section overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping of sections {sorted(_SECTIONS)}")
    sections: dict[str, Any] = {}
    for name, value in data.items():
        if name not in _SECTIONS:
            raise ValueError(
                f"{path}: unknown config section '{name}'; valid: {', '.join(sorted(_SECTIONS))}"
            )
        sections[name] = from_dict(_SECTIONS[name], value or {}, name)
    cfg = XllmConfig(**sections)
    for name, changes in (overrides or {}).items():
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes:
            cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)})
    cfg.validate()
    return cfg
