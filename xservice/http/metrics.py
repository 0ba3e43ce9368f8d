"""Prometheus metrics of one service instance, in a registry owned by that instance.

Request-level latencies are observed by the serving layer as tokens arrive; engine gauges are
refreshed from ``EngineStats`` when ``/metrics`` is scraped. Every quantity vLLM also exports is
exported again under vLLM's name (``xservice/http/metrics_vllm.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xengine.api.messages import EngineStats
from xservice.http.metrics_kv_tiers import KVTiersCollector
from xservice.http.metrics_lora import LoRACollector
from xservice.http.metrics_vllm import VllmNamesCollector

if TYPE_CHECKING:
    from xservice.engine.protocol import EngineBackend

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_MAX_TOKENS_BUCKET = 1 << 20


def token_buckets(max_model_len: int | None) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (token-count histograms; as vLLM's)."""
    limit = max_model_len or DEFAULT_MAX_TOKENS_BUCKET
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServiceMetrics:
    """All metrics the service exports; one instance per app."""

    def __init__(self, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.model_name = "unknown"  # the served name, for the vLLM-named metrics' label (set by the app)
        self.engine_stats: EngineStats | None = None  # from the last scrape
        r.register(KVTiersCollector(lambda: self.engine_stats))  # per KV tier (metrics_kv_tiers.py)
        r.register(LoRACollector(lambda: self.engine_stats))  # LoRA adapters (metrics_lora.py)
        self.ttft = Histogram(
            "xllm_time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "xllm_time_per_output_token_seconds",
            "(e2e - ttft) / (output tokens - 1), per request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "xllm_inter_token_latency_seconds",
            "Gap between consecutive tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "xllm_e2e_request_latency_seconds", "Arrival to last token.", buckets=_E2E_BUCKETS, registry=r
        )
        self.num_running = Gauge("xllm_num_requests_running", "Requests running in the engine.", registry=r)
        self.num_waiting = Gauge("xllm_num_requests_waiting", "Requests waiting in the engine.", registry=r)
        self.kv_usage = Gauge("xllm_kv_cache_usage_ratio", "Fraction of KV blocks in use.", registry=r)
        self.prefix_hit_rate = Gauge(
            "xllm_prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens.", registry=r
        )
        self.kv_free_blocks = Gauge("xllm_kv_free_blocks", "Free KV blocks.", registry=r)
        self.kv_pool_usage = Gauge(
            "xllm_kv_pool_usage_ratio",
            "Fraction of each KV pool's blocks in use (full_attention; sliding_window with cache.hybrid_kv).",
            ["pool"],
            registry=r,
        )
        self.kv_pool_free_blocks = Gauge(
            "xllm_kv_pool_free_blocks", "Free blocks of each KV pool.", ["pool"], registry=r
        )
        self.num_preemptions = Gauge(
            "xllm_num_preemptions", "Preemptions since the engine started.", registry=r
        )
        self.spec_num_drafts = Gauge(
            "xllm_spec_decode_num_drafts",
            "Sequence-steps that drafted tokens (speculative decoding).",
            registry=r,
        )
        self.spec_num_draft_tokens = Gauge(
            "xllm_spec_decode_num_draft_tokens", "Draft tokens proposed (speculative decoding).", registry=r
        )
        self.spec_num_accepted_tokens = Gauge(
            "xllm_spec_decode_num_accepted_tokens",
            "Draft tokens accepted (speculative decoding).",
            registry=r,
        )
        self.spec_accepted_per_pos = Gauge(
            "xllm_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: a step's first draft token).",
            ["position"],
            registry=r,
        )
        self.xtensor_pages = Gauge(
            "xllm_kv_xtensor_pages",
            "xTensor KV pages by state (free, allocated, mapped, reusable).",
            ["state"],
            registry=r,
        )
        self.xtensor_map_calls = Gauge(
            "xllm_kv_xtensor_map_calls",
            "xTensor page map / unmap operations since the engine started.",
            ["op"],
            registry=r,
        )
        self.offline_interrupted_steps = Gauge(
            "xllm_offline_interrupted_steps",
            "Offline prefill steps stopped between layers for an online arrival (co-location).",
            registry=r,
        )
        self.offline_paused_steps = Gauge(
            "xllm_offline_paused_steps",
            "Of those, steps kept and carried on from the layer where they stopped (not recomputed).",
            registry=r,
        )
        self.offline_preemption_latency = Gauge(
            "xllm_offline_preemption_latency_ms",
            "Online requests that arrived during offline work: arrival to the start of their prefill.",
            ["quantile"],
            registry=r,
        )
        self.graph_recompiles = Gauge(
            "xllm_graph_recompiles_after_warmup",
            "Graph compilations after start-up (should stay 0).",
            registry=r,
        )
        self.graph_replays = Gauge(
            "xllm_graph_replays", "Engine steps run through a captured graph.", registry=r
        )
        self.moe_balancedness = Gauge(
            "xllm_moe_balancedness",
            "Expert parallel: mean / max tokens per rank over EPLB's window, per MoE layer (1 = even).",
            ["layer"],
            registry=r,
        )
        self.moe_eplb_swaps = Gauge(
            "xllm_moe_eplb_swaps", "Expert placements switched by EPLB since the engine started.", registry=r
        )
        self.moe_comm_exposed = Gauge(
            "xllm_moe_comm_exposed_seconds",
            "Expert parallel: time rank 0 was blocked on MoE all-to-all / all-gather since start.",
            registry=r,
        )
        self.tp_all_reduces = Gauge(
            "xllm_tensor_parallel_all_reduces",
            "Tensor parallel: all-reduces rank 0 ran since start (label: the group's size).",
            ["tensor_parallel_size"],
            registry=r,
        )
        self.success = Counter(
            "xllm_request_success_total",
            "Finished sequences by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.slo = Counter(
            "xllm_request_slo_total",
            "Finished requests that set an SLO (body 'slo' or x-slo-* headers), by whether they met it.",
            ["result"],
            registry=r,
        )
        self.errors = Counter(
            "xllm_request_errors_total", "Error responses by HTTP status.", ["code"], registry=r
        )
        self.prompt_tokens = Counter(
            "xllm_prompt_tokens_total", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens = Counter("xllm_generation_tokens_total", "Generated tokens.", registry=r)
        self.prompt_images = Counter(
            "xllm_prompt_images", "Images in the prompts of admitted requests.", registry=r
        )
        self.prompt_image_tokens = Counter(
            "xllm_prompt_image_tokens",
            "Image tokens (image pads, also counted in xllm_prompt_tokens) of admitted requests.",
            registry=r,
        )
        self.prompt_tokens_cached = Counter(
            "xllm_prompt_tokens_cached_total",
            "Prompt tokens of finished requests served from the prefix cache.",
            registry=r,
        )
        self.queue_time = Histogram(
            "xllm_request_queue_time_seconds",
            "From the engine receiving a request to its first scheduling.",
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "xllm_request_prompt_tokens", "Prompt tokens per request.", buckets=tokens, registry=r
        )
        self.request_generation_tokens = Histogram(
            "xllm_request_generation_tokens",
            "Generated tokens per finished sequence.",
            buckets=tokens,
            registry=r,
        )
        self.request_params_n = Histogram(
            "xllm_request_params_n", "The 'n' of each request.", buckets=_N_BUCKETS, registry=r
        )
        self.request_params_max_tokens = Histogram(
            "xllm_request_params_max_tokens",
            "The resolved max_tokens of each request.",
            buckets=tokens,
            registry=r,
        )
        engine_counters = _EngineCountersCollector(self)
        r.register(engine_counters)
        sources = [
            self.num_running,
            self.num_waiting,
            self.kv_usage,
            self.num_preemptions,
            self.spec_num_drafts,
            self.spec_num_draft_tokens,
            self.spec_num_accepted_tokens,
            self.spec_accepted_per_pos,
            engine_counters,
            self.prompt_tokens,
            self.generation_tokens,
            self.prompt_tokens_cached,
            self.success,
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_params_n,
            self.request_params_max_tokens,
        ]
        r.register(VllmNamesCollector(sources, lambda: self.model_name))

    def watch_engine(self, client: EngineBackend) -> None:
        """Export ``client``'s health and supervisor counters (read at each scrape), and dynamic PD's
                pools, flips and predictor errors when ``client`` is an instance pool running it (and PrfaaS's
        threshold and link when it has a PrfaaS cluster)."""
        self.registry.register(_EngineHealthCollector(client))
        if getattr(client, "dynamic", None) is not None:
            from xservice.cluster.pd_metrics import DynamicPDCollector

            self.registry.register(DynamicPDCollector(client.dynamic))
        if getattr(client, "prfaas", None) is not None:
            from xservice.cluster.prfaas.metrics import PrfaasCollector

            self.registry.register(PrfaasCollector(client.prfaas))

    def watch_batch_runner(self, state: Callable[[], Any]) -> None:
        """Export the batch runner's health; ``state()`` returns its ``BatchRunnerState`` (read at each scrape)."""
        self.registry.register(_BatchRunnerCollector(state))

    def record_error(self, status: int) -> None:
        self.errors.labels(code=str(status)).inc()

    def update_engine(self, stats: EngineStats) -> None:
        """Copy the engine's gauges from a fresh ``EngineStats``."""
        self.engine_stats = stats
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_free_blocks.set(stats.num_free_blocks)
        self.kv_pool_usage.labels(pool="full_attention").set(stats.kv_usage)
        self.kv_pool_free_blocks.labels(pool="full_attention").set(stats.num_free_blocks)
        if stats.window_pool is not None:
            self.kv_pool_usage.labels(pool="sliding_window").set(stats.window_pool.usage)
            self.kv_pool_free_blocks.labels(pool="sliding_window").set(stats.window_pool.num_free_blocks)
        if stats.state_pool is not None:  # recurrent layers: free state slots count as free "blocks"
            self.kv_pool_usage.labels(pool="recurrent_state").set(stats.state_pool.usage)
            self.kv_pool_free_blocks.labels(pool="recurrent_state").set(stats.state_pool.num_free_seq_slots)
        self.num_preemptions.set(stats.num_preemptions)
        spec = stats.spec_decode
        if spec is not None:
            self.spec_num_drafts.set(spec.num_drafts)
            self.spec_num_draft_tokens.set(spec.num_draft_tokens)
            self.spec_num_accepted_tokens.set(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.accepted_per_pos):
                self.spec_accepted_per_pos.labels(position=str(pos)).set(n)
        if stats.graph is not None:
            self.graph_recompiles.set(stats.graph.num_recompiles_after_warmup)
            self.graph_replays.set(stats.graph.num_replays)
        if stats.xtensor is not None:
            xt = stats.xtensor
            for state in ("free", "allocated", "mapped", "reusable"):
                self.xtensor_pages.labels(state=state).set(getattr(xt, f"num_{state}"))
            self.xtensor_map_calls.labels(op="map").set(xt.num_maps)
            self.xtensor_map_calls.labels(op="unmap").set(xt.num_unmaps)
        if stats.colocation is not None:
            col = stats.colocation
            self.offline_interrupted_steps.set(col.num_interrupted_steps)
            self.offline_paused_steps.set(col.num_paused_steps)
            self.offline_preemption_latency.labels(quantile="0.5").set(col.preemption_latency_p50_ms)
            self.offline_preemption_latency.labels(quantile="0.99").set(col.preemption_latency_p99_ms)
        if stats.moe is not None:
            for layer, value in enumerate(stats.moe.balancedness):
                self.moe_balancedness.labels(layer=str(layer)).set(value)
            self.moe_eplb_swaps.set(stats.moe.num_swaps)
            self.moe_comm_exposed.set(stats.moe.comm_exposed_s)
            if stats.moe.tensor_parallel_size > 1:
                size = str(stats.moe.tensor_parallel_size)
                self.tp_all_reduces.labels(tensor_parallel_size=size).set(stats.moe.num_all_reduces)
        queries = stats.prefix_cache_queries
        self.prefix_hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# EngineStats field -> (counter name without "_total", help) of the vision-language image path
_IMAGE_COUNTERS = {
    "num_encode_steps": (
        "xllm_encode_steps",
        "Engine steps that carried image encodes (scheduler.encode_scheduling: stage).",
    ),
    "num_image_encodes": ("xllm_images_encoded", "Images run through the vision encoder."),
    "num_image_tokens_encoded": ("xllm_image_tokens_encoded", "Image tokens of the images encoded."),
    "num_image_cache_hits": (
        "xllm_image_cache_hits",
        "Images of requests served from the instance's image-embedding cache instead of the encoder.",
    ),
}


class _EngineCountersCollector:
    """The engine's running totals as of the last scrape: ``xllm_prefix_cache_queries_total`` /
    ``xllm_prefix_cache_hits_total`` (prompt tokens looked up in the prefix cache, and found) and the
    image path's (``_IMAGE_COUNTERS``; 0 for a text model)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        stats = self._metrics.engine_stats or EngineStats()
        yield CounterMetricFamily(
            "xllm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "xllm_prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        for field, (name, doc) in _IMAGE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, getattr(stats, field))


class _EngineHealthCollector:
    """``xllm_engine_restarts_total{instance}``, ``xllm_engine_restart_gave_up{instance}`` and
    ``xllm_engine_available``, from the engine backend (a supervised engine or the instance pool)."""

    def __init__(self, client: EngineBackend) -> None:
        self._client = client

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        restarts = CounterMetricFamily(
            "xllm_engine_restarts", "Engine processes restarted by the supervisor.", labels=["instance"]
        )
        for name, count in sorted(self._client.restart_counts().items()):
            restarts.add_metric([name], count)
        yield restarts
        gave_up = GaugeMetricFamily(
            "xllm_engine_restart_gave_up",
            "1 for an instance whose restart budget is spent (the supervisor gave up on it).",
            labels=["instance"],
        )
        for name in self._client.given_up():
            gave_up.add_metric([name], 1.0)
        yield gave_up
        available = GaugeMetricFamily("xllm_engine_available", "1 when an engine can serve requests, else 0.")
        available.add_metric([], 1.0 if self._client.is_alive else 0.0)
        yield available


class _BatchRunnerCollector:
    """``xllm_batch_runner_healthy``, ``xllm_batch_runner_errors_total`` (job-store failures),
    ``xllm_batch_lines_quarantined_total`` and ``xllm_batch_lines_timed_out_total``."""

    def __init__(self, state: Callable[[], Any]) -> None:
        self._state = state

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        s = self._state()
        yield GaugeMetricFamily(
            "xllm_batch_runner_healthy",
            "1 while the batch runner works, 0 while its job store keeps failing (it retries with backoff).",
            1.0 if s.healthy else 0.0,
        )
        yield CounterMetricFamily(
            "xllm_batch_runner_errors",
            "Batch job-store calls that failed (I/O, read-only, full).",
            s.num_store_errors,
        )
        yield CounterMetricFamily(
            "xllm_batch_lines_quarantined",
            "Batch lines never run again because the service or engine died under them too often.",
            s.num_quarantined,
        )
        yield CounterMetricFamily(
            "xllm_batch_lines_timed_out", "Batch lines stopped at batch.line_timeout_s.", s.num_timed_out
        )


class RequestTimer:
    """Latency bookkeeping of one request; ``finish`` observes TTFT, TPOT and E2E."""

    def __init__(self, metrics: ServiceMetrics, arrival: float | None = None) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival  # time.monotonic() clock
        self.first_token: float | None = None
        self._last_token: dict[int, float] = {}  # sequence index -> time of its last token
        self._scheduled = False  # queue time observed (the engine may report it per sequence)

    def on_tokens(self, index: int, num_new: int) -> None:
        """Call when ``num_new`` tokens of sequence ``index`` arrive together (one engine step)."""
        if num_new <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
        last = self._last_token.get(index)
        if last is not None:
            self.metrics.itl.observe(now - last)
        self._last_token[index] = now
        self.metrics.generation_tokens.inc(num_new)

    def on_scheduled(self, queue_time_s: float) -> None:
        """Call when the engine reports how long the request waited before it first ran (once)."""
        if not self._scheduled:
            self._scheduled = True
            self.metrics.queue_time.observe(queue_time_s)

    def finish(self, max_seq_tokens: int) -> tuple[float | None, float | None]:
        """Observe E2E and TPOT; ``max_seq_tokens`` is the longest sequence's length. Returns (TTFT,
        TPOT) in seconds (None: no token / a single one)."""
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrival)
        tpot = None
        if self.first_token is not None and max_seq_tokens > 1:
            tpot = (now - self.first_token) / (max_seq_tokens - 1)
            self.metrics.tpot.observe(tpot)
        return (None if self.first_token is None else self.first_token - self.arrival), tpot
