"""``benchmarks/epd_goodput.py``'s pure parts: every profiler row maps to a cluster config that validates,
the best split of each strategy is taken from the profiler's table, image requests carry their images."""

from __future__ import annotations

import pytest

from benchmarks.epd_deploy import instances_flag
from benchmarks.epd_goodput import deployments
from benchmarks.serving.client import RequestSpec, build_payload
from xservice.cluster.config_legacy import cluster_from_dict
from xservice.policies.epd import STRATEGIES, splits


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_split_of_every_strategy_is_a_valid_cluster(strategy: str) -> None:
    for counts in splits(4, len(STRATEGIES[strategy])):
        epd, instances = instances_flag(strategy, dict(zip(STRATEGIES[strategy], counts)))
        cluster_from_dict({"launch": {"instances": instances}, "epd": {"strategy": epd}}).validate()
        assert len(instances.split(",")) == 4
    assert instances_flag("EPD", {"EPD": 3}) == ("none", "engine-0:mixed,engine-1:mixed,engine-2:mixed")


def test_deployments_take_each_strategys_best_row_and_flag_the_choice() -> None:
    table = [
        {"strategy": "EP+D", "counts": {"EP": 2, "D": 1}, "goodput": 9.0},
        {"strategy": "EPD", "counts": {"EPD": 3}, "goodput": 8.0},
        {"strategy": "EP+D", "counts": {"EP": 1, "D": 2}, "goodput": 7.0},
        {"strategy": "E+P+D", "counts": {"E": 1, "P": 1, "D": 1}, "goodput": 6.0},
    ]
    rows = deployments({"strategies": table, "choice": table[0]})
    assert [(r["strategy"], r["counts"], r["chosen"]) for r in rows] == [
        ("E+P+D", {"E": 1, "P": 1, "D": 1}, False),
        ("EP+D", {"EP": 2, "D": 1}, True),
        ("EPD", {"EPD": 3}, False),
    ]


def test_chat_payload_puts_the_images_before_the_text() -> None:
    spec = RequestSpec("http://x/v1", "chat", "m", "hi", 1, 4, image_urls=("data:a", "data:b"))
    content = build_payload(spec)["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "image_url", "text"]
    assert content[1]["image_url"]["url"] == "data:b" and content[2]["text"] == "hi"
    plain = build_payload(RequestSpec("http://x/v1", "chat", "m", "hi", 1, 4))
    assert plain["messages"] == [{"role": "user", "content": "hi"}]
