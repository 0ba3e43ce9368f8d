"""``StatsCollector``: the base of the ``/metrics`` collectors that read the service's last ``EngineStats``
at scrape time (``metrics_kv_tiers.py``, ``metrics_lora.py``)."""

from __future__ import annotations

from collections.abc import Callable

from xengine.api.messages import EngineStats


class StatsCollector:
    """A prometheus custom collector over ``stats()`` (None before the first scrape of the engine)."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def describe(self) -> list[object]:
        return []
