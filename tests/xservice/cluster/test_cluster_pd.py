"""PD disaggregation end to end: ``xllm serve`` with 2 prefill + 2 decode real engine instances, the
prompt KV moving over a real Mooncake transfer engine (TCP, loopback), the embedded metadata store.

In file order: a batch through PD equals one colocated engine (and KV really moved); every socket
of the cluster listens on loopback only, the KV transfer ports inside ``kv_transfer_port_range``; a follow-up
sharing a prefix transfers fewer blocks (decode-side prefix hit); ``kill -9`` of a decode instance
mid-stream (migration); ``kill -9`` of a prefill instance holding requests (re-dispatch); with no
prefill instance left requests run whole on the decode instance. Greedy outputs always equal the
colocated engine's: no token lost or repeated.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.xservice.cluster.helpers import (
    ClusterServer,
    colocated_texts,
    complete,
    ppid,
    process_tree,
    tcp_listeners,
    wait_until,
)

pytest.importorskip("mooncake.engine")

INSTANCES = "prefill-0:prefill,prefill-1:prefill,decode-0:decode,decode-1:decode"
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank. "
BATCH = [f"Prompt {i}: " + SENTENCE * (i % 4 + 1) for i in range(6)] + [
    "Hi",
    "Shared system prompt. " * 8 + "First question?",
]
SHARED = "You are a careful assistant who answers briefly. " * 7
STREAMS = [f"Stream {i}: once upon a time in a land far away there lived a" for i in range(4)]
BATCH_TOKENS, STREAM_TOKENS = 24, 224  # streams mid-flight when an instance is killed (max_model_len 256)
KV_PORTS = (23400, 23499)  # cache.kv_transfer_port_range
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(
        model_dir,
        {
            "instances": INSTANCES,
            "metadata_store": "embedded",
            "lease_ttl_s": 3.0,
            "heartbeat_interval_s": 0.5,
        },
        {"engine_max_restarts": 0},  # these tests take instances away one by one: no relaunch
        engine={"cache": {"kv_transfer_port_range": "{}-{}".format(*KV_PORTS)}},
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, str]:
    """Greedy texts of one colocated offline ``LLM`` with the instances' settings."""
    prompts = [(p, BATCH_TOKENS) for p in BATCH + [SHARED + "Question A?", SHARED + "Question B?"]]
    return colocated_texts(model_dir, prompts + [(p, STREAM_TOKENS) for p in STREAMS])


def _parallel(fn, items: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(items)

    def run(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except Exception as e:  # noqa: BLE001 - reported by the caller's assertions
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    return results


def _kv_imported(cluster: ClusterServer) -> dict[str, dict[str, int]]:
    return {n: i["kv_imported"] for n, i in cluster.instances().items() if i["role"] == "decode"}


def test_pd_batch_is_token_identical_to_a_colocated_engine(cluster: ClusterServer, expected) -> None:
    client = cluster.openai()
    outs = _parallel(lambda p: complete(client, p, BATCH_TOKENS), BATCH)
    for prompt, out in zip(BATCH, outs):
        assert not isinstance(out, Exception), out
        assert out.choices[0].text == expected[prompt], f"{prompt!r} differs"
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == BATCH_TOKENS
    admin = cluster.admin()
    assert admin["pd"]["num_requests"] >= len(BATCH) and admin["pd"]["num_fallbacks"] == 0
    imported = _kv_imported(cluster)
    assert sum(c["blocks"] for c in imported.values()) >= 8  # the long prompts' whole blocks moved
    assert sum(c["bytes"] for c in imported.values()) > 0
    routed = {n: i["num_routed"] for n, i in cluster.instances().items()}
    assert all(routed[n] > 0 for n in routed)  # both prefill and both decode instances served


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (Debian iproute2)")
def test_the_cluster_listens_on_loopback_only(cluster: ClusterServer) -> None:
    watchdog = cluster.proc.pid  # ``xllm serve``: the watchdog, whose child is the API server
    engines = {i["pid"]: i for i in cluster.instances().values()}
    assert len(engines) == 4
    tree = process_tree(watchdog)  # the service, its engines and any helper process
    assert set(engines) <= tree
    (service,) = {ppid(pid) for pid in engines}  # the API server launched them all
    assert ppid(service) == watchdog
    listening = tcp_listeners(tree)
    assert service in listening
    for pid, addrs in listening.items():
        assert all(host in LOOPBACK for host, _ in addrs), (pid, addrs)  # nothing on 0.0.0.0 / [::]
    lo, hi = KV_PORTS
    for pid, inst in engines.items():
        assert ppid(pid) == service  # re-executed with the bind-host shim: same pid, same parent
        with open(f"/proc/{pid}/maps") as f:
            assert "/bind_host-" in f.read(), inst["name"]
        ports = {p for _, p in listening[pid]}
        kv_ports = {p for p in ports if lo <= p <= hi}  # the KV transfer engine's handshake + data
        assert len(kv_ports) == 2, (inst["name"], listening[pid])
        assert int(inst["address"].rsplit(":", 1)[1]) in ports - kv_ports  # ZMQ input


def test_decode_side_prefix_hit_transfers_fewer_blocks(cluster: ClusterServer, expected) -> None:
    client = cluster.openai()
    before = _kv_imported(cluster)
    indexed = {n: i["num_kv_blocks_indexed"] for n, i in cluster.instances().items()}
    first = complete(client, SHARED + "Question A?", BATCH_TOKENS)
    assert first.choices[0].text == expected[SHARED + "Question A?"]
    mid = _kv_imported(cluster)
    holder = next(n for n in mid if mid[n]["blocks"] > before[n]["blocks"])
    num_first = mid[holder]["blocks"] - before[holder]["blocks"]
    assert num_first >= 6
    # the decode instance's KV events reach the service's index; cache-aware pairing then picks it
    # (counted from before the first request: the earlier tests' blocks are indexed there too)
    wait_until(
        lambda: cluster.instances()[holder]["num_kv_blocks_indexed"] >= indexed[holder] + num_first,
        what="KV events",
    )
    second = complete(client, SHARED + "Question B?", BATCH_TOKENS)
    assert second.choices[0].text == expected[SHARED + "Question B?"]
    after = _kv_imported(cluster)
    hits = after[holder]["hit_blocks"] - mid[holder]["hit_blocks"]
    moved = after[holder]["blocks"] - mid[holder]["blocks"]
    assert hits >= num_first - 1 and moved < num_first  # the shared prefix stayed on the decode side


def test_prompt_side_outputs_through_the_cluster(cluster: ClusterServer, model_dir: Path) -> None:
    """Embeddings and prompt scoring (prefill-only: routed whole to one instance, never PD) and
    ``prompt_logprobs`` through PD (the prefill instance computes them) equal HF's."""
    import torch
    from transformers import AutoModel

    from tests.xengine.conftest import HFOracle

    client, ids = cluster.openai(), [(11 * i) % 2000 + 3 for i in range(60)]
    want = HFOracle(model_dir).logits(ids)[:-1].log_softmax(-1)
    want = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(model_dir, dtype=torch.float32)(
            torch.tensor([ids])
        ).last_hidden_state
    emb = client.embeddings.create(model="xllm-tiny", input=ids, encoding_format="float").data[0].embedding
    assert torch.allclose(torch.tensor(emb), torch.nn.functional.normalize(hidden[0, -1], dim=0), atol=1e-5)
    pd_before = cluster.admin()["pd"]["num_requests"]
    scored = client.completions.create(model="xllm-tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert cluster.admin()["pd"]["num_requests"] == pd_before
    out = client.completions.create(
        model="xllm-tiny", prompt=ids, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    field = out.choices[0].model_extra["prompt_logprobs"]
    assert [field[i][str(ids[i])]["logprob"] for i in range(1, 60)] == pytest.approx(want, abs=1e-4)
    assert cluster.admin()["pd"]["num_requests"] == pd_before + 1


def test_structured_output_resumes_on_the_decode_instance(cluster: ClusterServer) -> None:
    """The prefill instance samples the first token under the grammar; the decode instance goes on
    with the same document (its matcher resumed past that token) instead of starting a new one."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    }
    client, pd_before = cluster.openai(), cluster.admin()["pd"]["num_requests"]
    for seed in range(3):
        out = client.completions.create(
            model="xllm-tiny",
            prompt=f"Record {seed}:",
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            extra_body={
                "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
                "structured_outputs": {"disable_any_whitespace": True},
            },
        )
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        jsonschema.validate(json.loads(out.choices[0].text), schema)
    assert cluster.admin()["pd"]["num_requests"] == pd_before + 3  # all three went through PD


def stream_completion(client: openai.OpenAI, prompt: str, chunks: list[str]) -> str | None:
    finish = None
    for chunk in complete(client, prompt, STREAM_TOKENS, stream=True):
        chunks.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return finish


def _run_streams_killing(cluster: ClusterServer, kill) -> list[str]:
    """Stream every prompt of ``STREAMS`` while ``kill(chunks)`` kills an instance; the texts."""
    client = cluster.openai()
    chunks: list[list[str]] = [[] for _ in STREAMS]
    results: list[Any] = [None] * len(STREAMS)

    def run(i: int) -> None:
        try:
            results[i] = stream_completion(client, STREAMS[i], chunks[i])
        except Exception as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STREAMS))]
    [t.start() for t in threads]
    kill(chunks)
    [t.join(120) for t in threads]
    assert results == ["length"] * len(STREAMS), results
    return ["".join(c) for c in chunks]


def test_kill_9_of_a_decode_instance_mid_stream_migrates(cluster: ClusterServer, expected) -> None:
    before = cluster.admin()["num_migrations"]
    victim: dict[str, Any] = {}

    def kill(chunks: list[list[str]]) -> None:
        wait_until(lambda: all(len(c) >= 3 for c in chunks), 60, "streams to start")

        def busiest_decode() -> dict[str, Any] | None:
            decodes = [i for i in cluster.instances().values() if i["role"] == "decode"]
            busiest = max(decodes, key=lambda i: i["num_inflight"])
            return busiest if busiest["num_inflight"] > 0 else None

        victim.update(wait_until(busiest_decode, 30, "a decode instance with streams in flight"))
        os.kill(victim["pid"], signal.SIGKILL)

    texts = _run_streams_killing(cluster, kill)
    assert texts == [expected[p] for p in STREAMS]
    assert cluster.admin()["num_migrations"] > before
    wait_until(lambda: victim["name"] not in cluster.instances(), 10, "the dead decode instance to go")


def test_kill_9_of_a_prefill_instance_re_dispatches_its_prefills(cluster: ClusterServer, expected) -> None:
    before = cluster.admin()["pd"]["num_prefill_retries"]
    victim = cluster.instances()["prefill-0"]
    os.kill(victim["pid"], signal.SIGSTOP)  # frozen: requests routed to it wait in its prefill

    def kill(chunks: list[list[str]]) -> None:
        try:
            wait_until(lambda: cluster.instances()["prefill-0"]["num_inflight"] > 0, 10, "a stuck prefill")
        finally:
            os.kill(victim["pid"], signal.SIGKILL)

    texts = _run_streams_killing(cluster, kill)
    assert texts == [expected[p] for p in STREAMS]
    assert cluster.admin()["pd"]["num_prefill_retries"] > before
    wait_until(lambda: "prefill-0" not in cluster.instances(), 10, "the dead prefill instance to go")


def test_without_prefill_instances_requests_run_whole_on_a_decode_instance(
    cluster: ClusterServer, expected
) -> None:
    os.kill(cluster.instances()["prefill-1"]["pid"], signal.SIGKILL)
    wait_until(lambda: "prefill-1" not in cluster.instances(), 10, "the last prefill instance to go")
    client = cluster.openai()
    outs = _parallel(lambda p: complete(client, p, BATCH_TOKENS), BATCH[:3])
    assert [o.choices[0].text for o in outs] == [expected[p] for p in BATCH[:3]]
    assert [i["role"] for i in cluster.instances().values()] == ["decode"]
