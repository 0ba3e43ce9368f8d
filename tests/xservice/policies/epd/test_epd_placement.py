"""EPD placement (pure policy) and the service's global image index (fed by store events)."""

from __future__ import annotations

import time

from xengine.api.cluster import keys
from xengine.api.cluster.store import WatchEvent
from xservice.cluster.epd import image_index
from xservice.cluster.epd.image_index import ImageIndex
from xservice.policies import InstanceSnapshot
from xservice.policies.epd.placement import select_by_images


def test_a_full_holder_wins_over_load_and_ties_go_to_load_then_name() -> None:
    idle, busy = InstanceSnapshot("a", num_inflight=0), InstanceSnapshot("b", num_inflight=3)
    assert select_by_images([idle, busy], {"b": 2}, 2).name == "b"
    assert select_by_images([idle, busy], {"b": 2}, 2).holds_all
    assert select_by_images([idle, busy], {}, 2) == select_by_images([busy, idle], {}, 2)
    assert (
        select_by_images([idle, busy], {}, 2).name == "a"
        and not select_by_images([idle, busy], {}, 2).holds_all
    )
    assert select_by_images([InstanceSnapshot("y"), InstanceSnapshot("x")], {}, 1).name == "x"
    assert select_by_images([], {"a": 1}, 1) is None


def _put(name: str, incarnation: str, hashes: list[str]) -> WatchEvent:
    record = keys.ImageSet(incarnation=incarnation, seq=1, hashes=hashes)
    return WatchEvent("put", keys.key("/p", "images", name), keys.encode(record), 1)


def test_index_keeps_the_registered_incarnations_set_and_the_services_recent_notes(monkeypatch) -> None:
    registered = {"e0": "inc-1", "e1": "inc-2"}
    index = ImageIndex(store=None, key_prefix="/p", incarnation_of=registered.get)  # type: ignore[arg-type]
    index.apply(_put("e0", "inc-1", ["h1", "h2"]))
    index.apply(_put("e1", "old-incarnation", ["h1"]))  # a previous process of e1: ignored
    assert index.held(["h1", "h2", "h3"]) == {"e0": 2}
    index.note("e1", ["h3"])
    assert index.held(["h3"]) == {"e1": 1}
    now = time.monotonic()
    monkeypatch.setattr(image_index.time, "monotonic", lambda: now + image_index.NOTED_FOR_S + 1)
    assert index.held(["h3"]) == {}  # a note lasts until the instance's own set would show it
    index.apply(WatchEvent("delete", keys.key("/p", "images", "e0"), b"", 2))
    assert index.held(["h1", "h2"]) == {}
    index.apply(WatchEvent("put", keys.key("/p", "images", "e0"), b"not json", 3))  # malformed: dropped
    assert index.held(["h1"]) == {}
