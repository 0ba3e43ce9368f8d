"""Service configuration and the top-level config file (``xllm serve --config FILE``).

A YAML file maps 1:1 onto ``XllmConfig``: sections ``service``, ``model``, ``cache``,
``scheduler``, ``device``, ``execution``, ``parallel``, ``batch``, ``cluster`` (the last in
sub-sections; its former flat keys load with a warning, ``xservice/cluster/config_legacy.py``).
Unknown keys are an error. Torch-free.
"""

from __future__ import annotations

import dataclasses
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from xengine.api.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ExecutionConfig,
    KVTiersConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    _f,
    from_dict,
)
from xengine.api.envs import API_KEY
from xengine.api.media import MediaLimits
from xengine.api.paths import cache_dir
from xservice.cluster.config import ClusterConfig
from xservice.cluster.config_legacy import cluster_from_dict, replace_cluster
from xservice.policies.restart import RestartPolicy

ENV_API_KEY = API_KEY.name


def read_api_key_file(path: str) -> str:
    """The API key in ``path``; refuses a missing or empty file and one group or others may access."""
    where = Path(path).expanduser()
    try:
        mode = where.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"API key file {str(where)!r} is accessible by group/others (mode {stat.S_IMODE(mode):o}); "
                f"run: chmod 600 {where}"
            )
        key = where.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {str(where)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"API key file {str(where)!r} is not UTF-8 text") from None
    if not key:
        raise ValueError(f"API key file {str(where)!r} is empty")
    return key


@dataclass(frozen=True)
class ServiceConfig:
    host: str = _f("127.0.0.1", "Address to bind the HTTP server to (loopback by default).")
    port: int = _f(8000, "HTTP port.")
    watchdog: bool = _f(
        True,
        "Run the API server under a small watchdog process that holds the port and restarts the server "
        "after a crash (native fault, OOM kill, kill -9) with the engine restart policy's backoff and "
        "budget; off: run it directly under your own process manager.",
    )
    api_key: str | None = field(
        default=None,
        repr=False,  # a secret: never in a printed config
        metadata={
            "help": "If set, every route but /health* requires 'Authorization: Bearer <key>'. A flag is "
            f"visible in 'ps': prefer service.api_key_file or ${ENV_API_KEY} (used when neither is set)."
        },
    )
    api_key_file: str = _f(
        "",
        "File holding the API key (surrounding whitespace ignored); its mode must deny group and others "
        "(chmod 600). Not together with service.api_key.",
    )
    max_body_bytes: int = _f(4 * 1024 * 1024, "Largest accepted request body; larger bodies get 413.")
    max_messages: int = _f(
        4096,
        "Most chat messages (or Responses API input items) in one request, counted before the body is "
        "validated; more get a 400 naming 'messages' (or 'input'). The batch chat endpoint counts all its "
        "conversations' messages together.",
    )
    max_content_parts: int = _f(
        8192,
        "Most content parts (text, image_url, ...) over all messages of one request, counted before the "
        "body is validated; more get a 400 naming the message where the count passed the limit.",
    )
    max_pending_requests: int = _f(512, "Requests in flight (running + waiting) before new ones get 429.")
    max_n: int = _f(16, "Largest 'n' accepted over HTTP.")
    engine_startup_timeout_s: float = _f(900.0, "How long to wait for the engine process to become ready.")
    log_level: str = _f("info", "Log level: debug, info, warning, error.")
    keep_alive_s: float = _f(
        30.0,
        "How long an idle HTTP keep-alive connection stays open, in seconds. Keep it above the clients' own "
        "idle expiry (httpx and the openai client: 5 s), or a client may send on a connection being closed.",
    )
    engine_max_restarts: int = _f(
        5,
        "Engine restarts allowed within engine_restart_window_s when an engine process dies (single node and "
        "launched cluster instances); one more death and the supervisor gives up (liveness then fails).",
    )
    engine_restart_window_s: float = _f(
        300.0, "Window over which engine_max_restarts is counted, in seconds."
    )
    engine_restart_backoff_s: float = _f(
        1.0, "Delay before the first restart; doubles with each recent restart (at most 30 s)."
    )
    engine_hang_timeout_s: float = _f(
        120.0,
        "An engine that answers no request audit for this long while requests are in flight is treated as "
        "hung: its requests fail over and the supervisor restarts it.",
    )
    tool_call_parser: str = _f(
        "auto",
        "How tool calls are found in model output for tool_choice 'auto': a parser family ('hermes': Qwen2.5, "
        "Qwen3, Hermes), 'none', or 'auto' (from the chat template's call syntax, else the architecture).",
    )
    reasoning_parser: str = _f(
        "none",
        "How a thinking model's reasoning is split out of chat output into 'reasoning' / 'reasoning_content': "
        "'qwen3' (Qwen3; honours enable_thinking), 'deepseek_r1' (DeepSeek-R1), or 'none'.",
    )
    trust_request_chat_template: bool = _f(
        False,
        "Accept 'chat_template' in chat requests (a Jinja template, run sandboxed on the server).",
    )
    # Images in chat requests (vision-language models; docs/multimodal.md). Never fetched from the network.
    allowed_local_media_path: str = _f(
        "",
        "Folder whose image files chat requests may name (file:// URLs or paths under it); empty: none, "
        "only data: URLs.",
    )
    max_image_bytes: int = _f(20 * 1024 * 1024, "Largest encoded image accepted in a request.")
    max_image_pixels: int = _f(40_000_000, "Largest decoded image (width * height) accepted in a request.")
    max_images_per_request: int = _f(16, "Most images accepted in one chat request.")
    # vLLM's server options of the OpenAI surface (same names, same meaning)
    enable_force_include_usage: bool = _f(
        False, "Streams carry usage on every chunk (and the final usage chunk) whatever stream_options say."
    )
    return_tokens_as_token_ids: bool = _f(
        False,
        "Logprob tokens as 'token_id:<id>' unless a request says otherwise (its return_tokens_as_token_ids).",
    )
    enable_server_load_tracking: bool = _f(
        False, "GET /load answers {'server_load': generation requests in flight}."
    )
    enable_tokenizer_info_endpoint: bool = _f(
        False, "GET /tokenizer_info: the tokenizer's configuration and chat template (it may expose them)."
    )
    enable_per_request_metrics: bool = _f(
        False,
        "Responses (and a stream's final usage chunk) carry 'metrics': TTFT, generation and queue time, mean "
        "ITL and tokens/s of the request (n = 1).",
    )
    record_trace: str = _f(
        "",
        "Append one JSON line per finished request (arrival, prompt and output tokens, TTFT, TPOT) to this "
        "file: a served trace the cluster simulator replays (python -m benchmarks.cluster_sim --replay FILE). "
        "Empty: off.",
    )

    def with_api_key(self) -> ServiceConfig:
        """This config with its API key resolved: ``api_key``, else ``api_key_file``, else ``$XLLM_API_KEY``."""
        if self.api_key and self.api_key_file:
            raise ValueError(
                "give service.api_key (--api-key) or service.api_key_file (--api-key-file), not both"
            )
        if self.api_key:
            return self
        key = read_api_key_file(self.api_key_file) if self.api_key_file else API_KEY.get()
        return dataclasses.replace(self, api_key=key.strip() or None, api_key_file="")

    def validate(self) -> None:
        if not (0 <= self.port < 65536):
            raise ValueError("service.port must be in [0, 65535]")
        if self.max_body_bytes < 1024:
            raise ValueError("service.max_body_bytes must be >= 1024")
        if self.max_pending_requests < 1:
            raise ValueError("service.max_pending_requests must be >= 1")
        if self.max_messages < 1 or self.max_content_parts < 1:
            raise ValueError("service.max_messages and service.max_content_parts must be >= 1")
        if (
            self.engine_max_restarts < 0
            or self.engine_restart_window_s <= 0
            or self.engine_restart_backoff_s < 0
        ):
            raise ValueError(
                "service.engine_max_restarts must be >= 0, engine_restart_window_s > 0, engine_restart_backoff_s >= 0"
            )
        if self.keep_alive_s <= 0:
            raise ValueError("service.keep_alive_s must be > 0")
        if self.engine_hang_timeout_s <= 0:
            raise ValueError("service.engine_hang_timeout_s must be > 0")
        if min(self.max_image_bytes, self.max_image_pixels, self.max_images_per_request) < 1:
            raise ValueError(
                "service.max_image_bytes, max_image_pixels and max_images_per_request must be >= 1"
            )
        if self.allowed_local_media_path and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(
                f"service.allowed_local_media_path {self.allowed_local_media_path!r} is not a folder"
            )
        from xservice.serving.tools.registry import setting_names

        if self.tool_call_parser not in setting_names():
            raise ValueError(f"service.tool_call_parser must be one of {', '.join(setting_names())}")
        from xservice.serving.reasoning.registry import setting_names as reasoning_names

        if self.reasoning_parser not in reasoning_names():
            raise ValueError(f"service.reasoning_parser must be one of {', '.join(reasoning_names())}")

    def media_limits(self) -> MediaLimits:
        """The bounds on a request's images."""
        return MediaLimits(
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_images_per_request=self.max_images_per_request,
        )

    def restart_policy(self) -> RestartPolicy:
        """The supervisor's restart policy from these settings."""
        return RestartPolicy(
            max_restarts=self.engine_max_restarts,
            window_s=self.engine_restart_window_s,
            initial_backoff_s=self.engine_restart_backoff_s,
        )


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
    max_line_attempts: int = _f(
        3,
        "Times a batch line may be sent and end with no result because the service or its engine stopped "
        "(crash, kill, hang) while it ran; a line at this count is quarantined: it fails with "
        "'line_quarantined' in the error file and is never sent again.",
    )
    line_timeout_s: float = _f(
        3600.0,
        "Wall-clock budget of one batch line, in seconds; a line still running then is stopped and fails "
        "with 'line_timeout' in the error file.",
    )
    store_retry_s: float = _f(
        60.0,
        "How long the batch runner retries (with backoff) a job store that cannot be read or written "
        "before it fails the current batch; it keeps looping either way.",
    )
    max_files: int = _f(10_000, "Most files in the store (uploads and batch outputs); more uploads get 409.")
    max_total_file_bytes: int = _f(
        50 * 1024**3, "Most bytes in the store's files (uploads and batch outputs); more uploads get 409."
    )
    max_files_per_caller: int = _f(
        1000, "Most uploaded files per API key (one caller, 'anonymous', when auth is off); more get 409."
    )
    max_file_bytes_per_caller: int = _f(
        10 * 1024**3, "Most uploaded bytes per API key ('anonymous' when auth is off); more get 409."
    )

    @property
    def resolved_data_dir(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return cache_dir() / "batch"

    def validate(self) -> None:
        if self.max_file_bytes < 1024:
            raise ValueError("batch.max_file_bytes must be >= 1024")
        if self.max_concurrent_lines < 1:
            raise ValueError("batch.max_concurrent_lines must be >= 1")
        if self.max_line_attempts < 1:
            raise ValueError("batch.max_line_attempts must be >= 1")
        if self.line_timeout_s <= 0 or self.store_retry_s < 0:
            raise ValueError("batch.line_timeout_s must be > 0 and batch.store_retry_s >= 0")
        quotas = (self.max_files, self.max_total_file_bytes, self.max_files_per_caller)
        if min(quotas + (self.max_file_bytes_per_caller,)) < 1:
            raise ValueError(
                "batch.max_files, max_total_file_bytes, max_files_per_caller and max_file_bytes_per_caller "
                "must be >= 1"
            )


@dataclass(frozen=True)
class XllmConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_tiers: KVTiersConfig = field(default_factory=KVTiersConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            cache=self.cache,
            scheduler=self.scheduler,
            device=self.device,
            execution=self.execution,
            parallel=self.parallel,
            structured_outputs=self.structured_outputs,
            speculative_config=self.speculative_config,
            kv_tiers=self.kv_tiers,
            lora=self.lora,
        )

    def validate(self) -> None:
        self.service.validate()
        self.engine.validate()
        self.batch.validate()
        self.cluster.validate()
        if self.cluster.enabled and self.parallel.data_parallel_size > 1:
            raise ValueError(
                "parallel.data_parallel_size > 1 is not supported in cluster mode yet (a cluster instance is "
                "one engine process); serve it single-node with xllm serve --data-parallel-size, or launch "
                "cluster instances with --expert-parallel-size / --tensor-parallel-size"
            )


_SECTIONS = {
    "service": ServiceConfig,
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "execution": ExecutionConfig,
    "parallel": ParallelConfig,
    "structured_outputs": StructuredOutputsConfig,
    "speculative_config": SpeculativeConfig,
    "kv_tiers": KVTiersConfig,
    "lora": LoRAConfig,
    "batch": BatchConfig,
    "cluster": ClusterConfig,
}


def load_config(path: str | Path | None, overrides: dict[str, dict[str, Any]] | None = None) -> XllmConfig:
    """Read a YAML config (or defaults when ``path`` is None) and apply per-section overrides.

    ``overrides["cluster"]`` may be nested (``{"pd": {"mode": "dynamic"}}``) or use the former flat keys."""
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
        if name == "cluster":  # sub-sections, and the former flat keys (with a warning)
            sections[name] = cluster_from_dict(value or {})
        else:
            sections[name] = from_dict(_SECTIONS[name], value or {}, name)
    cfg = XllmConfig(**sections)
    for name, changes in (overrides or {}).items():
        if name == "cluster":
            cfg = dataclasses.replace(cfg, cluster=replace_cluster(cfg.cluster, changes))
            continue
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes:
            cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)})
    cfg = dataclasses.replace(cfg, service=cfg.service.with_api_key())
    cfg.validate()
    return cfg
