"""Tests that apply to one EPD strategy are collected only for the clusters of that strategy."""

from __future__ import annotations

from pathlib import Path

import pytest

# test name -> the strategies it applies to (the cluster fixture is parametrized over every strategy)
ONLY_FOR: dict[str, set[str]] = {
    # only E+P+D has encoders apart from both the prefill and the decode instance
    "test_dead_encoders_leave_the_encoding_to_the_prefill_instance": {"E+P+D"},
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a conftest's hook sees the whole session's items: look only at this folder's
    here = Path(__file__).parent
    kept, dropped = [], []
    for item in items:
        strategies = ONLY_FOR.get(getattr(item, "originalname", ""))
        if strategies is None or here not in item.path.parents:
            kept.append(item)
            continue
        strategy, _arch = item.callspec.params["cluster"]
        (kept if strategy in strategies else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
