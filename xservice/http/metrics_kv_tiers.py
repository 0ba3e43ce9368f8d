"""``/metrics`` for the KV tiers behind the prefix cache (``xengine/tiered_kv.py``): per tier, blocks
held, hits, misses, bytes moved, evictions, checksum failures, errors, load time and availability,
read from the ``EngineStats`` of the last scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xservice.http.stats_collector import StatsCollector

_COUNTERS = {
    "hits": "Blocks loaded from the tier into the KV pool.",
    "misses": "Blocks looked up in the tier and not found (checksum failures included).",
    "bytes_read": "Bytes loaded from the tier.",
    "bytes_written": "Bytes written to the tier.",
    "writes": "Blocks written to the tier.",
    "evictions": "Blocks the tier dropped to make room.",
    "corrupt": "Blocks that failed their checksum or length check: dropped and recomputed, never served.",
    "errors": "Tier calls that failed (the store unreachable, a disk error).",
    "loads": "Load calls to the tier.",
    "load_s": "Seconds spent loading from the tier.",
}


class KVTiersCollector(StatsCollector):
    """Collects at scrape time from ``stats()`` (the service's last ``EngineStats``)."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        tiers = stats.kv_tiers if stats is not None else None
        if tiers is None:
            return
        for field, doc in _COUNTERS.items():
            family = CounterMetricFamily(f"xllm_kv_tier_{field}", doc, labels=["tier"])
            for t in tiers.tiers:
                family.add_metric([t.name], getattr(t, field))
            yield family
        blocks = GaugeMetricFamily("xllm_kv_tier_blocks", "Blocks each tier holds now.", labels=["tier"])
        up = GaugeMetricFamily(
            "xllm_kv_tier_available", "1 while the tier answers (0: the store is down).", labels=["tier"]
        )
        for t in tiers.tiers:
            blocks.add_metric([t.name], t.num_blocks)
            up.add_metric([t.name], 1.0 if t.available else 0.0)
        yield blocks
        yield up
        for field, doc in (
            ("num_prefetches", "Requests whose prompt the tiers held beyond the KV pool."),
            ("num_loaded_blocks", "Blocks loaded into the KV pool from the tiers."),
            ("num_prefetch_timeouts", "Requests admitted before their tier blocks arrived."),
            ("num_saved_blocks", "Blocks handed to the tiers."),
            ("num_saved_window_blocks", "Hybrid models: window blocks handed to the tiers."),
            ("num_saved_states", "Hybrid models: recurrent state snapshots handed to the tiers."),
            (
                "num_loaded_checkpoints",
                "Hybrid models: prefetches whose window blocks / state came from the tiers.",
            ),
        ):
            family = CounterMetricFamily(f"xllm_kv_tiers_{field}", doc)
            family.add_metric([], getattr(tiers, field))
            yield family
        latency = GaugeMetricFamily(
            "xllm_kv_tiers_load_latency_ms",
            "Prefetch latency (probe + load) of recent requests.",
            labels=["quantile"],
        )
        latency.add_metric(["0.5"], tiers.load_latency_p50_ms)
        latency.add_metric(["0.9"], tiers.load_latency_p90_ms)
        yield latency
