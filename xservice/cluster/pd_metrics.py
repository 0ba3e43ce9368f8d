"""Dynamic PD in ``/metrics``: pool sizes, flips by direction, and each predictor's error."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xservice.cluster.dynamic_pd import DynamicPD


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
