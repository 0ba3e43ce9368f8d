"""Prefill-as-a-Service in ``/metrics``: the threshold, the link (egress, capacity, backlog) and where
requests prefilled."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xservice.cluster.prfaas.router import PrfaasRouter


class PrfaasCollector:
    def __init__(self, router: PrfaasRouter) -> None:
        self._router = router

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        v = self._router.view()
        link = v["link"]
        gauges = (
            ("xllm_prfaas_threshold_tokens", "PrfaaS: the routing threshold t now.", v["threshold_tokens"]),
            ("xllm_prfaas_planned_threshold_tokens", "PrfaaS: the planned threshold.", v["planned_threshold_tokens"]),
            ("xllm_prfaas_link_egress_gbps", "PrfaaS: KV egress over the link (moving average).", link["egress_gbps"]),
            ("xllm_prfaas_link_capacity_gbps", "PrfaaS: the link's capacity (configured, or delivered when busy).",
             link["capacity_gbps"]),
            ("xllm_prfaas_link_utilization", "PrfaaS: egress over capacity.", link["utilization"]),
            ("xllm_prfaas_link_queue_seconds", "PrfaaS: KV still to cross, in seconds of link time.", link["queue_s"]),
            ("xllm_prfaas_instances", "PrfaaS: healthy PrfaaS prefill instances.", len(v["instances"])),
        )  # fmt: skip
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        sent = CounterMetricFamily("xllm_prfaas_link_sent_bytes", "PrfaaS: KV bytes that crossed the link.")
        sent.add_metric([], float(link["sent_bytes"]))
        yield sent
        routed = CounterMetricFamily(
            "xllm_prfaas_prefills", "PrfaaS: prefills by cluster (prfaas or local).", labels=["cluster"]
        )
        for cluster in ("prfaas", "local"):
            routed.add_metric([cluster], float(v["requests"][cluster]))
        yield routed
        moves = CounterMetricFamily(
            "xllm_prfaas_threshold_changes", "PrfaaS: threshold changes by the scheduler.", labels=["reason"]
        )
        for reason in ("raises", "lowers"):
            moves.add_metric([reason.rstrip("s")], float(v["requests"][f"threshold_{reason}"]))
        moves.add_metric(["plan"], float(v["requests"]["replans"]))
        yield moves
