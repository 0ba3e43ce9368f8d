"""``/metrics`` for LoRA serving: vLLM's ``vllm:lora_requests_info`` (the running and waiting requests'
adapters as labels, the scrape time as its value) and xllm's slot and folder loads, read from the
``EngineStats`` of the last scrape."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xservice.http.stats_collector import StatsCollector


class LoRACollector(StatsCollector):
    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        lora = stats.lora if stats is not None else None
        if lora is None:
            return
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (vLLM's metric: the adapters of running and waiting requests).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        labels = [str(lora.max_loras), ",".join(lora.running_adapters), ",".join(lora.waiting_adapters)]
        info.add_metric(labels, time.time())
        yield info
        yield GaugeMetricFamily("xllm_lora_adapters", "LoRA adapters registered.", value=lora.num_adapters)
        yield CounterMetricFamily(
            "xllm_lora_slot_loads",
            "Adapters written into a device slot (a miss of the slots).",
            value=lora.num_slot_loads,
        )
        yield CounterMetricFamily(
            "xllm_lora_disk_loads",
            "Adapters read from their folder (a miss of the host cache).",
            value=lora.num_disk_loads,
        )
