"""Prefill-as-a-Service end to end, between two Linux network namespaces (``ci/netns.sh``): ``xllm
serve`` with a local prefill and decode instance in the root namespace and a PrfaaS prefill instance
the service launches in the other one, its egress shaped by ``tc tbf``; KV crosses by Mooncake over TCP.

Greedy outputs of a real model equal a colocated engine's for prompts on both sides of the threshold;
only the prompt's increment crosses the link (a decode-side prefix hit is not sent again); the link
meter, ``/metrics`` and ``xllm cluster status`` show the traffic; with the link cut, the scheduler
raises the threshold. Skips with the reason where namespaces cannot be made (no root, no iproute2).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.xservice.cluster.helpers import ClusterServer, colocated_texts, complete, wait_until

pytest.importorskip("mooncake.engine")

ROOT = Path(__file__).resolve().parents[3]
NETNS = ROOT / "ci" / "netns.sh"
NS = "xprftest"
HOST_IP, NS_IP = "10.78.0.1", "10.78.0.2"
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "
SHORT = ["Hi there", SENTENCE]  # under the threshold (48 tokens): local prefill
# above it: PrfaaS. The second extends the first by more than the threshold: PrfaaS computes only the
# extension (its cache holds the rest) and the decode instance, holding the first's blocks, imports
# only the new ones across the link
LONG = [SENTENCE * 5, SENTENCE * 5 + "Then the dog woke up. " + SENTENCE * 4]
# a long document prefilled on PrfaaS and nowhere else (one token: no decode, no KV import), then a
# short question on it: with bandwidth to spare the question prefills locally, its prefix pulled
# across the link from the PrfaaS instance
DOC = "Chapter one. " + "A careful reader keeps the whole story in mind while reading. " * 6
QUESTION = DOC + "Who?"
TOKENS = 16


def _netns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(NETNS), *args, "--name", NS, "--local-ip", HOST_IP, "--remote-ip", NS_IP],
                          capture_output=True, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def link() -> Iterator[str]:
    check = subprocess.run([str(NETNS), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        pytest.skip(f"network namespaces cannot be made here: {check.stdout.strip() or check.stderr.strip()}")
    up = _netns("up", "--rate", "20mbit")
    assert up.returncode == 0, up.stderr
    yield NS
    _netns("down")


@pytest.fixture(scope="module")
def cluster(link: str, model_dir: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(
        model_dir,
        {
            "launch": {"instances": "p0:prefill,d0:decode"},
            "registry": {"store": "embedded"},
            "prfaas": {
                "enabled": True,
                "instances": "prfaas-0",
                "netns": link,
                "engine_host": NS_IP,
                "store_host": HOST_IP,
                "threshold_tokens": 48,
                "link_gbps": 0.02,
                "tick_s": 0.5,
                "max_queue_s": 1.0,
            },
        },  # fmt: skip
        {"engine_max_restarts": 0},
    )
    yield server
    server.stop()


def _link_bytes() -> int:
    return int(json.loads(_netns("stats").stdout)["sent_bytes"])


def test_greedy_outputs_across_the_namespaces_equal_a_colocated_engine(
    cluster: ClusterServer, model_dir
) -> None:
    expected = colocated_texts(model_dir, [(p, TOKENS) for p in SHORT + LONG])
    client = cluster.openai()
    before = _link_bytes()
    for prompt in SHORT + LONG:
        out = complete(client, prompt, TOKENS)
        assert out.choices[0].text == expected[prompt], f"{prompt[:30]!r} differs"
    prf = cluster.admin()["prfaas"]
    assert prf["requests"]["prfaas"] == len(LONG) and prf["requests"]["local"] == len(SHORT)
    inst = cluster.instances()
    assert inst["prfaas-0"]["pool"] == "prfaas" and inst["prfaas-0"]["num_routed"] == len(LONG)
    # the KV crossed the shaped link (the shaper counted it), and the service metered it
    assert prf["link"]["sent_bytes"] > 0 and prf["link"]["transfers"] == len(LONG)
    assert _link_bytes() - before >= prf["link"]["sent_bytes"]
    imported = inst["d0"]["kv_imported"]
    assert imported["hit_blocks"] >= 5  # the second long prompt's shared prefix was not sent again


def test_a_prefix_cached_on_prfaas_is_pulled_to_a_local_prefill(cluster: ClusterServer, model_dir) -> None:
    expected = colocated_texts(model_dir, [(QUESTION, TOKENS)])
    client = cluster.openai()
    before = cluster.admin()["prfaas"]["requests"]
    indexed = cluster.instances()["prfaas-0"]["num_kv_blocks_indexed"]
    assert complete(client, DOC, 1).usage.completion_tokens == 1  # prefilled on PrfaaS only
    # the PrfaaS instance reported the document's blocks (a heartbeat), and bandwidth is abundant: the
    # link's recent egress has decayed to a small share of it
    wait_until(
        lambda: cluster.instances()["prfaas-0"]["num_kv_blocks_indexed"] >= indexed + 8, 30, "the index"
    )
    wait_until(lambda: not cluster.admin()["prfaas"]["link"]["bandwidth_scarce"], 30, "an idle link")
    out = complete(client, QUESTION, TOKENS)
    assert out.choices[0].text == expected[QUESTION]
    after = cluster.admin()["prfaas"]["requests"]
    assert after["prfaas"] == before["prfaas"] + 1 and after["local"] == before["local"] + 1
    assert after["prefix_transfers"] == before["prefix_transfers"] + 1
    assert after["prefix_tokens"] - before["prefix_tokens"] >= 64  # the document's whole blocks


def test_metrics_and_cluster_status_show_the_link(cluster: ClusterServer) -> None:
    text = cluster.http.get("/metrics").text
    for name in (
        "xllm_prfaas_threshold_tokens",
        "xllm_prfaas_link_sent_bytes_total",
        "xllm_prfaas_link_utilization",
    ):
        assert name in text
    assert 'xllm_prfaas_prefills_total{cluster="prfaas"}' in text
    status = subprocess.run(
        [sys.executable, "-m", "xservice", "cluster", "status", "--url", f"http://127.0.0.1:{cluster.port}"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert "PrfaaS  threshold" in status.stdout and "prfaas-0" in status.stdout


def test_a_cut_link_raises_the_threshold(cluster: ClusterServer) -> None:
    assert _netns("rate", "--rate", "0.2mbit").returncode == 0  # 200 kbit/s: a long prompt's KV takes seconds
    try:
        client = cluster.openai()
        start = cluster.admin()["prfaas"]["threshold_tokens"]
        for i in range(2):
            complete(client, f"Request {i}: " + SENTENCE * 6, 4)
        raised = wait_until(
            lambda: cluster.admin()["prfaas"]["threshold_tokens"] > start,
            30,
            "the scheduler to raise the threshold",
        )
        assert raised
        prf = cluster.admin()["prfaas"]
        assert prf["requests"]["threshold_raises"] >= 1
        assert any(h["reason"] == "raise" for h in prf["history"])
    finally:
        _netns("rate", "--rate", "20mbit")
        time.sleep(0.5)
