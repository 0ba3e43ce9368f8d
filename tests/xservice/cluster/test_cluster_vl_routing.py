"""Cache-aware routing of image prompts in a colocated cluster (no EPD): ``xllm serve`` of a tiny
Qwen2-VL over two real engine instances.

The engines' prefix caches key an image's pads by its content hash (``cache_token_ids``), and so do
the KV events they publish; the service must match a prompt the same way, or an image prompt's
blocks never match and its follow-ups go wherever the load says. Here the first image chat goes to
the idle instance while the other streams a long chat about another image of the same size (both
then hold the chat template's text block); the follow-ups (same image, other questions) arrive when
both are idle, so only a match on the image's blocks sends them back to the first one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.xengine.vl_oracle import random_image, user_turn
from tests.xservice.cluster.helpers import ClusterServer, wait_until

pytest.importorskip("mooncake.engine")
openai = pytest.importorskip("openai")

IMAGE = random_image(224, 224, seed=7)  # 64 image tokens: 4 full 16-token blocks
OTHER = random_image(224, 224, seed=8)  # same size: its pads are the same plain token ids
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(make_model_dir) -> Iterator[ClusterServer]:
    vl_dir = make_model_dir("qwen2_vl")
    server = ClusterServer(
        vl_dir,
        {
            "instances": "engine-0:mixed,engine-1:mixed",
            "metadata_store": "embedded",
            "routing_policy": "cache_aware",
        },
        {"max_body_bytes": 16 << 20},
        engine={"model": {"max_model_len": 512, "served_model_name": "xllm-tiny-vl"}},
    )
    yield server
    server.stop()


def _routed(server: ClusterServer) -> dict[str, int]:
    return {n: i["num_routed"] for n, i in server.instances().items()}


def _idle(instance: dict[str, Any]) -> bool:
    load = instance["load"] or {}
    return not instance["num_inflight"] and not load.get("num_running") and not load.get("num_waiting")


def test_image_follow_ups_go_to_the_instance_holding_the_image_blocks(server: ClusterServer) -> None:
    client = server.openai()
    started = threading.Event()

    def long_stream() -> None:
        for chunk in client.chat.completions.create(
            model="xllm-tiny-vl", messages=[user_turn(OTHER, "Tell me a long story.")], max_tokens=300,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        ):  # fmt: skip
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()

    before = _routed(server)
    indexed = {n: i["num_kv_blocks_indexed"] for n, i in server.instances().items()}
    busy = threading.Thread(target=long_stream)
    busy.start()
    assert started.wait(120), "the long stream never started"
    busy_name = next(n for n, c in _routed(server).items() if c > before[n])
    first = client.chat.completions.create(
        model="xllm-tiny-vl", messages=[user_turn(IMAGE, "What is in this picture?")], **GREEDY
    )
    assert first.usage.prompt_tokens > 64
    busy.join()
    after_first = _routed(server)
    holder = next(n for n in after_first if n != busy_name)
    assert after_first[holder] == before[holder] + 1, "the image chat should have gone to the idle instance"
    wait_until(
        lambda: server.instances()[holder]["num_kv_blocks_indexed"] >= indexed[holder] + 4,
        what="the holder's KV events",
    )
    wait_until(
        lambda: all(_idle(i) for i in server.instances().values()), what="both instances reporting idle"
    )

    for question in ("Describe the colours.", "Is there a person in it?"):
        out = client.chat.completions.create(
            model="xllm-tiny-vl", messages=[user_turn(IMAGE, question)], **GREEDY
        )
        assert out.usage.prompt_tokens_details.cached_tokens >= 64
    final = _routed(server)
    assert final[holder] - after_first[holder] == 2, (before, after_first, final)
    assert final[busy_name] == after_first[busy_name]
