"""PD with a KV store tier: the prefill instance dies after its prefill (its export done, the decode
side's import not yet), and the decode instance loads the prompt's KV from the Mooncake Store (written
through by the prefill instance) instead of the prefill being redone: ``xllm serve`` with one prefill and
one decode instance, the store started by the service (``kv_tiers.store_master: auto``). The decode
instance is frozen (``SIGSTOP``) while the prefill instance is killed, so the import cannot run before
the death; the text equals a colocated engine's."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.xservice.cluster.helpers import ClusterServer, colocated_texts, complete, wait_until

PROMPT = "PD restore: " + " ".join(f"v{i}" for i in range(30))
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(
        model_dir,
        {
            "instances": "prefill-0:prefill,decode-0:decode",
            "metadata_store": "embedded",
            "lease_ttl_s": 30.0,  # outlives the decode instance's freeze below
            "heartbeat_interval_s": 0.5,
        },
        {"engine_max_restarts": 0},
        engine={"kv_tiers": {"store_master": "auto", "store_memory_gb": 0.25}},
    )
    yield server
    server.stop()


def _store_tier(stats: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in stats["kv_tiers"]["tiers"] if t["name"] == "store")


def test_decode_loads_the_prompt_from_the_store_when_its_prefill_instance_died(
    cluster: ClusterServer, model_dir: Path
) -> None:
    expected = colocated_texts(model_dir, [(PROMPT, MAX_TOKENS)])[PROMPT]
    instances = cluster.instances()
    prefill, decode = instances["prefill-0"], instances["decode-0"]
    chunks: list[str] = []

    def stream() -> None:
        for chunk in complete(cluster.openai(), PROMPT, MAX_TOKENS, stream=True):
            chunks.append(chunk.choices[0].text)

    os.kill(decode["pid"], signal.SIGSTOP)  # its import of the prompt waits until it resumes
    try:
        thread = threading.Thread(target=stream)
        thread.start()
        wait_until(lambda: chunks, 60, "the first token, from the prefill instance")

        written = lambda: cluster.admin()["kv_store_blocks_indexed"] > 0  # noqa: E731 - its KV events
        wait_until(written, 60, "the prefill instance's prompt blocks in the store")
        time.sleep(0.5)  # its export (one RPC, milliseconds after the first token) has returned
        os.kill(prefill["pid"], signal.SIGKILL)
    finally:
        os.kill(decode["pid"], signal.SIGCONT)
    thread.join(120)
    assert "".join(chunks) == expected
    pd = cluster.admin()["pd"]
    assert pd["num_store_restores"] >= 1 and pd["num_prefill_retries"] == 0, pd
    stats = cluster.http.get("/v1/admin/stats").json()["instances"]["decode-0"]
    assert _store_tier(stats)["hits"] > 0  # the prompt's whole blocks came from the store
