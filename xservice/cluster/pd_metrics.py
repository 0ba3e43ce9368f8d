"""Dynamic PD in ``/metrics``: pool sizes, flips by direction, and each predictor's error."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xservice.cluster.dynamic_pd import DynamicPD


@dataclass
class PDCounters:
    """PD disaggregation's counters (``xservice/cluster/pd.py``)."""

    num_requests: int = 0  # requests that ran PD disaggregated
    num_prefill_retries: int = 0  # prefills re-dispatched or redone after a prefill instance failed
    num_fallbacks: int = 0  # requests (or decode halves) that ran without a KV transfer
    num_kept_on_prefill: int = 0  # dynamic PD: decoded on the prefill instance (no transfer needed)
    # the prefill instance died after its export: the decode side loaded the prompt from the KV store
    num_store_restores: int = 0


class DynamicPDCollector:
    def __init__(self, dynamic: DynamicPD) -> None:
        self._dynamic = dynamic

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        d = self._dynamic
        pools = GaugeMetricFamily(
            "xllm_pd_pool_size", "Dynamic PD: healthy instances per pool.", labels=["pool"]
        )
        for pool, names in d.pools().items():
            pools.add_metric([pool], len(names))
        yield pools
        flips = CounterMetricFamily(
            "xllm_pd_flips", "Dynamic PD: role flips by direction.", labels=["direction"]
        )
        for direction, count in sorted(d.num_flips.items()):
            flips.add_metric([direction], count)
        yield flips
        error = GaugeMetricFamily(
            "xllm_pd_predictor_error",
            "Dynamic PD: recent mean relative error of each instance's TTFT / TPOT predictions.",
            labels=["instance", "model"],
        )
        for name, mon in sorted(d.monitor.instances.items()):
            for model, predictor in (("ttft", mon.ttft), ("tpot", mon.tpot)):
                if predictor.error is not None:
                    error.add_metric([name, model], predictor.error)
        yield error
