"""Online/offline co-location on real processes: ``xllm serve`` with ``cluster.colocation`` over a
prefill instance (latency-relaxed pool) and a decode instance (latency-strict pool), a batch job
through the ``openai`` client's Files and Batches API, and online streams beside it.

Every output must equal a colocated engine's greedy text; offline requests must prefill on the
relaxed instance and decode on either (here the TPOT SLO is loose, so the strict pool admits them);
online arrivals must stop offline prefill steps on the relaxed instance between layers; online
streams asking for a TPOT SLO the strict batch cannot hold move its offline decodes back to the
relaxed instance mid-stream.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.xservice.cluster.helpers import ROOT, ClusterServer, colocated_texts, wait_until

pytest.importorskip("mooncake.engine")

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "
OFFLINE = [f"Report {i}: " + SENTENCE * 7 + "In short:" for i in range(24)]  # ~170 tokens each
ONLINE = [f"Question {i}: what is the capital of a country far away?" for i in range(8)]
OFFLINE_TOKENS, ONLINE_TOKENS = 6, 8
CLUSTER = {
    "instances": "p0:prefill,d0:decode",
    "metadata_store": "embedded",
    "colocation": True,
    "tpot_slo_ms": 2000.0,  # loose: the strict pool admits offline decodes
    "engine_nice": 5,  # the front door ahead of the engines on shared cores
}
ENGINE = {
    "cache": {"kv_transfer_port_range": "23600-23699"},
    # small steps: an offline prompt prefills over several interruptible steps
    "scheduler": {"max_num_batched_tokens": 64},
}


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(model_dir, CLUSTER, engine=ENGINE)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    return colocated_texts(
        model_dir, [(p, OFFLINE_TOKENS) for p in OFFLINE] + [(p, ONLINE_TOKENS) for p in ONLINE]
    )


def _submit(client: openai.OpenAI, prompts: list[str], max_tokens: int = OFFLINE_TOKENS) -> str:
    lines = [
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": "xllm-tiny",
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )
        for i, p in enumerate(prompts)
    ]
    file = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    return client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    ).id


def _results(client: openai.OpenAI, batch_id: str, prompts: list[str]) -> dict[str, str]:
    batch = wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in ("completed", "failed") and b, 180, "batch"
    )
    assert batch.status == "completed" and batch.request_counts.failed == 0, batch
    out = {}
    for line in client.files.content(batch.output_file_id).text.splitlines():
        row = json.loads(line)
        out[prompts[int(row["custom_id"].split("-")[1])]] = row["response"]["body"]["choices"][0]["text"]
    return out


def _online(client: openai.OpenAI, prompt: str, max_tokens: int = ONLINE_TOKENS, **extra: Any) -> str:
    stream = client.completions.create(
        model="xllm-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    return "".join(c.choices[0].text for c in stream if c.choices)


def _stats(cluster: ClusterServer) -> dict[str, Any]:
    return cluster.http.get("/v1/admin/stats").json()["colocation"]


def test_engines_run_at_the_configured_nice(cluster: ClusterServer) -> None:
    insts = cluster.http.get("/v1/admin/instances").json()["instances"]
    assert len(insts) == 2
    for inst in insts:  # every thread of the engine process, torch's and zmq's included
        tids = [int(t) for t in os.listdir(f"/proc/{inst['pid']}/task")]
        assert len(tids) > 1 and {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {5}, inst["name"]
    with open(f"/proc/{insts[0]['pid']}/stat") as f:  # the service (the engines' parent) is not lowered
        service_pid = int(f.read().rsplit(")", 1)[1].split()[1])
    assert os.getpriority(os.PRIO_PROCESS, service_pid) == 0


def test_batch_job_beside_online_streams_is_exact_and_uses_both_pools(
    cluster: ClusterServer, expected: dict[str, str]
) -> None:
    client = cluster.openai()
    batch_id = _submit(client, OFFLINE)
    online: dict[str, Any] = {}

    def send_online() -> None:
        for p in ONLINE:
            try:
                online[p] = _online(client, p)
            except Exception as e:  # noqa: BLE001 - reported by the assertion
                online[p] = e
            time.sleep(0.05)

    sender = threading.Thread(target=send_online)
    sender.start()
    offline = _results(client, batch_id, OFFLINE)
    sender.join(180)
    assert online == {p: expected[p] for p in ONLINE}
    assert offline == {p: expected[p] for p in OFFLINE}
    view = cluster.admin()["colocation"]
    assert view["enabled"] and view["pools"] == {"latency_relaxed": ["p0"], "latency_strict": ["d0"]}
    assert view["offline_prefills"] >= len(OFFLINE)
    assert view["offline_decodes_strict"] >= 1, view  # the loose SLO admits them to the strict batch
    assert view["offline_decodes_strict"] + view["offline_decodes_relaxed"] >= len(OFFLINE)
    instances = cluster.instances()
    assert instances["d0"]["colocation"]["roofline"]["num_observed"] > 0
    # the operator's view: ``xllm cluster status``
    cli = subprocess.run(
        [sys.executable, "-m", "xservice", "cluster", "status", "--url", f"http://127.0.0.1:{cluster.port}"],
        capture_output=True, text=True, timeout=60, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "co-location  relaxed: p0  strict: d0" in cli.stdout and "d0" in cli.stdout


def test_online_arrivals_stop_offline_prefill_between_layers(
    cluster: ClusterServer, expected: dict[str, str]
) -> None:
    """Online requests, one after another, while batch jobs prefill on the relaxed instance, until
    the engines report an interrupted step (a few jobs at most); outputs stay exact throughout."""
    client = cluster.openai()
    for _ in range(4):
        before = _stats(cluster)["num_interrupted_steps"]
        batch_id = _submit(client, OFFLINE)
        while client.batches.retrieve(batch_id).status in ("validating", "in_progress"):
            assert _online(client, ONLINE[0]) == expected[ONLINE[0]]
            if _stats(cluster)["num_interrupted_steps"] > before:
                break
        assert _results(client, batch_id, OFFLINE) == {p: expected[p] for p in OFFLINE}
        stats = _stats(cluster)
        if stats["num_interrupted_steps"] > before:
            break
    assert stats["offline_preemption"] == "layer" and stats["num_interrupted_steps"] > 0, stats
    # each interrupted step was either kept and resumed (the sync eager engines here) or computed again
    assert stats["num_paused_steps"] > 0 or stats["num_interrupted_tokens"] > 0, stats
    assert stats["num_latencies"] > 0
    metrics = cluster.http.get("/metrics").text
    assert "xllm_offline_interrupted_steps" in metrics
    paused = next(line for line in metrics.splitlines() if line.startswith("xllm_offline_paused_steps "))
    assert float(paused.split()[1]) == stats["num_paused_steps"]


LONG_OFFLINE = [f"Essay {i}: " + SENTENCE * 2 + "Go on:" for i in range(6)]  # ~35 tokens each
LONG_OFFLINE_TOKENS, TIGHT_ONLINE_TOKENS = 160, 200  # online streams span several rebalance checks


def test_online_streams_with_a_tight_tpot_slo_move_offline_decodes_off_the_strict_instance(
    cluster: ClusterServer, model_dir: Path
) -> None:
    """Offline decodes admitted to d0 under the loose SLO; then an online stream asking for 0.5 ms per
    token lands there: co-location moves the offline decodes back to p0 mid-stream (recompute of
    their generated tokens on top of p0's cached prompt), and every text stays exact."""
    expected = colocated_texts(
        model_dir, [(p, LONG_OFFLINE_TOKENS) for p in LONG_OFFLINE] + [(ONLINE[1], TIGHT_ONLINE_TOKENS)]
    )
    client = cluster.openai()
    for _ in range(3):
        before = cluster.admin()["colocation"]["offline_evictions"]
        batch_id = _submit(client, LONG_OFFLINE, LONG_OFFLINE_TOKENS)
        # tight online streams one after another while the job runs: between two of them d0 admits
        # offline decodes (the loose default SLO), and the next one's tight SLO moves them off
        while client.batches.retrieve(batch_id).status in ("validating", "in_progress"):
            online = _online(client, ONLINE[1], TIGHT_ONLINE_TOKENS, slo={"tpot_ms": 0.5})
            assert online == expected[ONLINE[1]]
            if cluster.admin()["colocation"]["offline_evictions"] > before:
                break
            time.sleep(0.1)
        assert _results(client, batch_id, LONG_OFFLINE) == {p: expected[p] for p in LONG_OFFLINE}
        view = cluster.admin()["colocation"]
        if view["offline_evictions"] > before:
            break
    assert view["offline_evictions"] > 0, view
    assert view["last_eviction"]["instance"] == "d0" and "SLO 0.5 ms" in view["last_eviction"]["reason"]
