"""Dynamic PD end to end: ``xllm serve`` with 1 prefill + 3 decode real engine instances, roles in a real
etcd, KV over a real Mooncake transfer engine (TCP, loopback), requests through the ``openai`` client.

In file order: the instances start in their launch pools and are profiled (predictors seeded); a
prefill-heavy burst whose requests carry a tight TTFT SLO of their own (``extra_body.slo``) queues up
on the one prefill instance, so a decode instance flips to prefill (D→P); a
decode-heavy phase makes the observed TPOT miss, so a prefill-side instance flips to decode (P→D);
an operator flip via the admin API followed at once by ``kill -9`` of the flipped instance while it
holds streams loses no request; a restarted service sees the roles in etcd. Greedy outputs always
equal one colocated engine's. No assertion is on time: SLOs are set so that the phases miss them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.xservice.cluster.helpers import (
    ClusterServer,
    EtcdServer,
    colocated_texts,
    freeze_a_busy_instance,
    wait_until,
)

pytest.importorskip("mooncake.engine")

PREFIX = "/xllm-dynpd-test"
INSTANCES = "p0:prefill,d0:decode,d1:decode,d2:decode"
KV_PORTS = (23500, 23599)
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "
# ~1200 tokens each: a prefill takes far longer than the service takes to dispatch the next request, so
# the burst queues up on p0 however fast the engine is
LONG = [f"Document {i}: " + SENTENCE * 80 + "Summary:" for i in range(12)]
MAX_MODEL_LEN = 2048
SHORT = [f"Tale {i}: once upon a time" for i in range(6)]
LONG_TOKENS, SHORT_TOKENS = 4, 384  # decode streams outlast the TPOT miss's sustain time
# the decode phase's own TPOT SLO: no step is predicted under it, so no prefill instance keeps a stream
# (however the fits came out on a busy host) and every stream on the decode side misses it
DECODE_TPOT_MS = 0.01
BURST_TTFT_MS = 1.0  # no prefill of a long prompt is predicted under it: the burst queues up on p0
CLUSTER = {
    "instances": INSTANCES,
    "metadata_store": "etcd",
    "key_prefix": PREFIX,
    "lease_ttl_s": 3.0,
    "heartbeat_interval_s": 0.5,
    "pd_mode": "dynamic",
    # the burst's requests ask for BURST_TTFT_MS themselves; any stream of the decode phase misses 1 ms
    # per token; every other prompt meets the default TTFT SLO (so no other D→P flip happens)
    "ttft_slo_ms": 5000.0,
    "tpot_slo_ms": 1.0,
    "min_decode_instances": 2,
    "flip_cooldown_s": 1.0,
    "flip_min_interval_s": 0.2,
    "tpot_miss_sustain_s": 0.3,
    "prefill_idle_s": 600.0,  # only TTFT / TPOT misses flip in this test
}


def _server(model_dir: Path, etcd: EtcdServer) -> ClusterServer:
    return ClusterServer(
        model_dir,
        {**CLUSTER, "etcd_endpoint": etcd.endpoint},
        engine={
            "model": {"max_model_len": MAX_MODEL_LEN},
            "cache": {"num_blocks": 1024, "kv_transfer_port_range": "{}-{}".format(*KV_PORTS)},
        },
    )


@pytest.fixture(scope="module")
def cluster(model_dir: Path, etcd: EtcdServer) -> Iterator[ClusterServer]:
    server = _server(model_dir, etcd)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    """Greedy texts of one colocated offline ``LLM`` with the instances' settings."""
    prompts = [(p, LONG_TOKENS) for p in LONG] + [(p, SHORT_TOKENS) for p in SHORT]
    return colocated_texts(model_dir, prompts, max_model_len=MAX_MODEL_LEN)


def _run_all(
    client: openai.OpenAI, prompts: list[str], max_tokens: int, gap_s: float = 0.0, **extra: Any
) -> dict[str, Any]:
    """Streaming completions of ``prompts`` on threads, started ``gap_s`` apart; prompt -> text or error."""
    out: dict[str, Any] = {}

    def run(prompt: str) -> None:
        try:
            stream = client.completions.create(
                model="xllm-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True, **extra},
            )  # fmt: skip
            out[prompt] = "".join(c.choices[0].text for c in stream if c.choices)
        except Exception as e:  # noqa: BLE001 - reported by the assertions
            out[prompt] = e

    threads = []
    for p in prompts:
        threads.append(threading.Thread(target=run, args=(p,)))
        threads[-1].start()
        time.sleep(gap_s)
    [t.join(180) for t in threads]
    return out


def _dyn(cluster: ClusterServer) -> dict[str, Any]:
    return cluster.admin()["dynamic_pd"]


def test_instances_start_in_their_pools_and_are_profiled(cluster: ClusterServer) -> None:
    dyn = _dyn(cluster)
    assert dyn["enabled"] and dyn["pools"] == {"P": ["p0"], "D": ["d0", "d1", "d2"], "P→D": [], "D→P": []}
    assert dyn["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 1.0}

    def profiled() -> bool:
        preds = [i["predictors"] for i in cluster.instances().values()]
        return all(p["ttft"]["num_samples"] >= 3 and p["tpot"]["num_samples"] >= 3 for p in preds)

    wait_until(profiled, 120, "start-up profiling of every instance")
    for inst in cluster.instances().values():
        assert inst["pool"] in ("P", "D") and inst["predictors"]["ttft"]["coef"][0] is not None


def test_prefill_heavy_burst_flips_a_decode_instance_to_prefill(
    cluster: ClusterServer, expected: dict[str, str]
) -> None:
    out = _run_all(cluster.openai(), LONG, LONG_TOKENS, slo={"ttft_ms": BURST_TTFT_MS})
    assert {p: out[p] for p in LONG} == {p: expected[p] for p in LONG}
    flips = _dyn(cluster)["flips"]
    to_prefill = [f for f in flips if f["to_role"] == "prefill"]
    assert to_prefill, (flips, {n: i["predictors"] for n, i in cluster.instances().items()})
    assert "TTFT" in to_prefill[0]["reason"] and to_prefill[0]["instance"].startswith("d")
    dyn = _dyn(cluster)
    assert len(dyn["pools"]["D"]) + len(dyn["pools"]["P→D"]) >= 2  # never below min_decode
    assert dyn["num_flips"]["D→P"] >= 1
    metrics = cluster.http.get("/metrics").text
    assert 'xllm_pd_flips_total{direction="D→P"}' in metrics
    assert 'xllm_pd_predictor_error{instance="p0",model="ttft"}' in metrics


def test_decode_heavy_phase_flips_a_prefill_instance_to_decode(
    cluster: ClusterServer, expected: dict[str, str]
) -> None:
    before = len(_dyn(cluster)["flips"])
    time.sleep(1.0)  # the opposite direction waits out the cooldown
    out = _run_all(cluster.openai(), SHORT, SHORT_TOKENS, gap_s=0.1, slo={"tpot_ms": DECODE_TPOT_MS})
    assert {p: out[p] for p in SHORT} == {p: expected[p] for p in SHORT}
    new = _dyn(cluster)["flips"][before:]
    to_decode = [f for f in new if f["to_role"] == "decode"]
    assert to_decode, (
        _dyn(cluster),
        {n: (i["pool"], i["predictors"]) for n, i in cluster.instances().items()},
    )
    assert "TPOT" in to_decode[0]["reason"]
    dyn = _dyn(cluster)
    assert len(dyn["pools"]["P"]) + len(dyn["pools"]["D→P"]) >= 1  # never below min_prefill


def test_operator_flip_then_kill_9_of_that_instance_loses_no_request(
    cluster: ClusterServer, expected: dict[str, str]
) -> None:
    client = cluster.openai()
    out: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: out.update(_run_all(client, SHORT, SHORT_TOKENS)))
    runner.start()

    def streaming_decode(i: dict[str, Any]) -> bool:  # reported streams past their first token
        return i["role"] == "decode" and bool(i["predictors"]["num_decoding"])

    decode_side = [i for i in cluster.instances().values() if i["role"] == "decode"]
    assert len(decode_side) >= 3, cluster.instances()
    # frozen from here to the kill: its streams cannot finish before it (the flip needs no answer from it)
    victim = wait_until(
        lambda: freeze_a_busy_instance(cluster, streaming_decode),
        60,
        "a decode instance with streams in flight",
    )
    try:
        resp = cluster.http.post(
            f"/v1/admin/instances/{victim['name']}/role", json={"role": "prefill", "reason": "test"}
        )
    finally:
        os.kill(victim["pid"], signal.SIGKILL)  # mid-flip: its streams are still running there
    assert resp.status_code == 200, resp.text
    assert victim["name"] in resp.json()["pools"]["D→P"] + resp.json()["pools"]["P"]
    runner.join(180)
    assert {p: out[p] for p in SHORT} == {p: expected[p] for p in SHORT}
    assert cluster.admin()["num_migrations"] >= 1, (victim, cluster.admin())


def test_admin_flip_rejects_bad_requests(cluster: ClusterServer) -> None:
    http = cluster.http
    assert http.post("/v1/admin/instances/nope/role", json={"role": "decode"}).status_code == 404
    r = http.post("/v1/admin/instances/p0/role", json={"role": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    assert http.post("/v1/admin/instances/p0/role", json={"role": "decode", "x": 1}).status_code in (400, 422)


def test_restarted_service_sees_the_roles_in_etcd(
    cluster: ClusterServer,
    model_dir: Path,
    etcd: EtcdServer,
) -> None:
    wait_until(lambda: len(cluster.instances()) == 4 and all(i["healthy"] for i in cluster.instances().values()),
               120, "the killed instance to be relaunched")  # fmt: skip

    def snapshot() -> tuple[dict[str, str], list]:
        return {n: i["role"] for n, i in cluster.instances().items()}, _dyn(cluster)["flips"]

    def settled() -> tuple[dict[str, str], list] | None:
        """Roles and flips read twice alike (a flip between the two reads would pair old roles with
        new flips)."""
        first = snapshot()
        time.sleep(0.3)
        return first if snapshot() == first else None

    roles, flips = wait_until(settled, 60, "a stable snapshot of the roles and flips")
    cluster.stop()
    again = _server(model_dir, etcd)
    try:
        assert "roles restored from the store" in again.log_path.read_text()
        wait_until(lambda: len(again.instances()) == 4, 120, "instances of the new service")

        def restored() -> bool:
            """The old roles and flips, plus any flip made since (the old service's last instants, or
            the new one's policy on its first snapshots)."""
            history = _dyn(again)["flips"]
            want = dict(roles)
            for flip in history[len(flips) :]:
                want[flip["instance"]] = flip["to_role"]
            got = {n: i["role"] for n, i in again.instances().items()}
            return history[: len(flips)] == flips and got == want

        wait_until(restored, 30, "the restored roles and flips")
    finally:
        again.stop()
