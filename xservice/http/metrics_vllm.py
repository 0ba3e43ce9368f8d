"""The service's metrics again under vLLM's names, so dashboards and alerts written for vLLM work.

Each ``vllm:*`` family mirrors one ``xllm_*`` family measuring the same quantity (``VLLM_NAMES``);
nothing is measured twice and no vLLM name is exported for a quantity xllm does not measure. The
mirrors carry vLLM's labels: ``model_name`` (the served model name) and ``engine`` (always "0":
in cluster mode the engine gauges and counters are the instances' sums, as one engine's would be).
Histogram buckets are xllm's own (queries with ``histogram_quantile`` do not depend on them).

vLLM's metric list: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) of vLLM 0.33.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric

# xllm family name -> (vLLM family name, vLLM type or None for "the same as xllm's")
VLLM_NAMES: dict[str, tuple[str, str | None]] = {
    # engine state (refreshed from the engine at each scrape)
    "xllm_num_requests_running": ("vllm:num_requests_running", None),
    "xllm_num_requests_waiting": ("vllm:num_requests_waiting", None),
    "xllm_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", None),  # both: 1.0 = full
    # cumulative engine counts (the engine counts them; xllm exports them as gauges of the total)
    "xllm_num_preemptions": ("vllm:num_preemptions", "counter"),
    "xllm_prefix_cache_queries": ("vllm:prefix_cache_queries", None),
    "xllm_prefix_cache_hits": ("vllm:prefix_cache_hits", None),
    "xllm_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "counter"),
    "xllm_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "counter"),
    "xllm_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "counter"),
    "xllm_spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "counter",
    ),
    # request counters
    "xllm_prompt_tokens": ("vllm:prompt_tokens", None),
    "xllm_generation_tokens": ("vllm:generation_tokens", None),
    "xllm_prompt_tokens_cached": ("vllm:prompt_tokens_cached", None),
    "xllm_request_success": ("vllm:request_success", None),
    # per-request histograms
    "xllm_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", None),
    "xllm_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", None),
    "xllm_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds", None),
    "xllm_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", None),
    "xllm_request_queue_time_seconds": ("vllm:request_queue_time_seconds", None),
    "xllm_request_prompt_tokens": ("vllm:request_prompt_tokens", None),
    "xllm_request_generation_tokens": ("vllm:request_generation_tokens", None),
    "xllm_request_params_n": ("vllm:request_params_n", None),
    "xllm_request_params_max_tokens": ("vllm:request_params_max_tokens", None),
    # not mirrored: the image path's counters (xllm_images_encoded, xllm_image_cache_hits, ...).
    # vllm:mm_cache_* count vLLM's input-processor cache (pixels), a quantity xllm does not have.
}

ENGINE_LABEL = "0"


class VllmNamesCollector:
    """Collects ``sources`` and yields their ``VLLM_NAMES`` families renamed, with vLLM's labels.

    ``model_name`` is called at each scrape (the served name is known once the app is built).
    """

    def __init__(self, sources: Iterable[Any], model_name: Callable[[], str]) -> None:
        self._sources = list(sources)
        self._model_name = model_name

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        labels = {"model_name": self._model_name(), "engine": ENGINE_LABEL}
        for source in self._sources:
            for family in source.collect():
                mapped = VLLM_NAMES.get(family.name)
                if mapped is not None:
                    yield _renamed(family, *mapped, labels)


def _renamed(family: Metric, name: str, typ: str | None, labels: dict[str, str]) -> Metric:
    out = Metric(name, family.documentation, typ or family.type)
    for sample in family.samples:
        if out.type == "counter" and family.type == "gauge":
            suffix = "_total"  # a gauge holding a running total becomes a counter
        else:
            suffix = sample.name[len(family.name) :]  # _bucket, _sum, _count, _total, _created
        out.add_sample(name + suffix, {**labels, **sample.labels}, sample.value, sample.timestamp)
    return out
