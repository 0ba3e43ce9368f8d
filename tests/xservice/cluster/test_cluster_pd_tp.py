"""PD between different parallel layouts end to end: ``xllm serve`` launching a TP = 2 prefill instance
and a TP = 1 decode instance (``cluster.launch.prefill_tensor_parallel_size``), and the other way
round. Each prompt's KV moves over the Mooncake transfer engine, every decode rank reading its own
KV heads from the prefill ranks holding them. The greedy texts equal one colocated engine's, and the
KV really moved.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.xservice.cluster.helpers import ClusterServer, colocated_texts, complete

pytest.importorskip("mooncake.engine")

PROMPTS = [f"Prompt {i}: " + "The quick brown fox jumps over the lazy dog. " * (i + 2) for i in range(3)]
TOKENS = 12
LAYOUTS = [(2, 1), (1, 2)]


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    return colocated_texts(model_dir, [(p, TOKENS) for p in PROMPTS])


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"prefill-tp{p}-decode-tp{d}" for p, d in LAYOUTS])
def cluster(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[ClusterServer]:
    prefill_tp, decode_tp = request.param
    server = ClusterServer(
        model_dir,
        {
            "launch": {
                "instances": "prefill-0:prefill,decode-0:decode",
                "prefill_tensor_parallel_size": prefill_tp,
                "decode_tensor_parallel_size": decode_tp,
            },
            "registry": {"store": "embedded", "lease_ttl_s": 3.0, "heartbeat_interval_s": 0.5},
        },
        {"engine_max_restarts": 0},
        engine={"cache": {"kv_transfer_port_range": "23500-23599"}},
    )
    yield server
    server.stop()


def test_pd_across_tp_layouts_gives_the_colocated_texts(cluster: ClusterServer, expected) -> None:
    client = cluster.openai()
    for prompt in PROMPTS:
        out = complete(client, prompt, TOKENS)
        assert out.choices[0].text == expected[prompt], f"{prompt!r} differs"
    admin = cluster.admin()
    assert admin["pd"]["num_requests"] >= len(PROMPTS) and admin["pd"]["num_fallbacks"] == 0
    imported = [i["kv_imported"] for i in cluster.instances().values() if i["role"] == "decode"]
    assert sum(c["blocks"] for c in imported) >= 6 and sum(c["bytes"] for c in imported) > 0
