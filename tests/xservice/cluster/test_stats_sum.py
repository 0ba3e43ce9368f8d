"""A cluster's stats: counters summed over the instances, KV usage their mean, latencies the worst."""

from __future__ import annotations

from xengine.api.messages import ColocationStatsMsg, EngineStats
from xservice.engine.stats_sum import sum_engine_stats


def test_counters_add_up_kv_usage_averages_and_latency_is_the_worst() -> None:
    a = EngineStats(num_running=2, num_waiting=1, kv_usage=0.2)
    b = EngineStats(num_running=3, num_waiting=0, kv_usage=0.6)
    a.colocation = ColocationStatsMsg(offline_preemption="layer", preemption_latency_p99_ms=4.0)
    b.colocation = ColocationStatsMsg(offline_preemption="layer", preemption_latency_p99_ms=9.0)
    total = sum_engine_stats([a, b])
    assert (total.num_running, total.num_waiting) == (5, 1)
    assert abs(total.kv_usage - 0.4) < 1e-9
    assert total.colocation.preemption_latency_p99_ms == 9.0
    assert total.xtensor is None and total.graph is None
