"""The engine plane is authenticated (ZMQ CURVE, one cluster key) and no client stream hangs silently.

A real cluster (``xllm serve`` with two local engine processes, embedded store) serves greedy streams
while rogue peers without the cluster key connect to an engine's command and output sockets and to
the embedded store's bridge: every handshake is refused (and counted, whether the ZAP handler or the
CURVE protocol itself refused it), no frame gets in or out, the streams finish untouched. Then a peer that *does* hold the key (a second service) takes an engine over with a
``Hello``: the engine aborts our requests and drops their outputs; the service notices (unasked abort
/ audit) and migrates the streams, which finish with the same tokens within a bounded time. An engine
frozen with SIGSTOP (alive, so only its lease tells) has its streams migrated the same way.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.xservice.cluster.helpers import (
    PROMPTS,
    ClusterServer,
    freeze_a_busy_instance,
    stream_completion,
    wait_until,
)
from xengine.api.cluster import keys
from xengine.api.cluster.store.base import StoreUnavailableError
from xengine.api.cluster.store.bridge import BridgeStoreClient
from xengine.api.messages import AddRequest, Hello, SamplingParams, make_encoder
from xengine.api.security import ClusterKey, read_key_file, secure_client

GUARD_S = 120.0  # a broken build must not hang the suite; not a timing assertion


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("auth") / "cluster.key"


@pytest.fixture(scope="module")
def cluster(model_dir: Path, key_file: Path) -> Iterator[ClusterServer]:
    server = ClusterServer(
        model_dir,
        {
            "instances": "engine-0:mixed,engine-1:mixed",
            "metadata_store": "embedded",
            "routing_policy": "round_robin",
            "auth_key_file": str(key_file),
        },
    )
    yield server
    server.stop()


def _run_streams(cluster: ClusterServer, during=None) -> dict[str, Any]:
    client = cluster.openai()
    out: dict[str, Any] = {}
    threads = [
        threading.Thread(target=stream_completion, args=(client, p, out, str(i)))
        for i, p in enumerate(PROMPTS)
    ]
    [t.start() for t in threads]
    if during is not None:
        wait_until(lambda: all(len(out.get(str(i), ())) >= 3 for i in range(len(PROMPTS))), 60, "streams")
        during()
    [t.join(GUARD_S) for t in threads]  # a stream still waiting after that has no finish: _texts fails
    return out


def _texts(out: dict[str, Any]) -> list[str]:
    assert not [k for k in out if k.endswith(":error")], out
    assert [out[f"{i}:finish"] for i in range(len(PROMPTS))] == ["length"] * len(PROMPTS)
    return ["".join(out[str(i)]) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def expected(cluster: ClusterServer) -> list[str]:
    return _texts(_run_streams(cluster))


def test_the_key_file_is_private(cluster: ClusterServer, key_file: Path) -> None:
    assert key_file.stat().st_mode & 0o777 == 0o600
    read_key_file(key_file)  # well-formed


def test_rogue_peers_are_refused_and_streams_are_untouched(
    cluster: ClusterServer, expected: list[str], key_file: Path
) -> None:
    target = cluster.instances()["engine-0"]
    migrations = cluster.admin()["num_migrations"]
    denied = cluster.http.get("/v1/admin/stats").json()["num_auth_denied"]
    ctx = zmq.Context()
    own = ClusterKey.generate()  # a peer with a key of its own, even knowing the engine's public key
    server_public = read_key_file(key_file).public
    rogues: list[zmq.Socket] = []
    stolen: list[bytes] = []

    def attack() -> None:
        enc = make_encoder()
        frames = [
            enc.encode(Hello(service_id="rogue")),
            enc.encode(AddRequest(req_id="rogue-1", prompt_token_ids=[1, 2, 3], params=SamplingParams())),
        ]
        for curve in (False, True):
            push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            for sock in (push, pull):
                if curve:
                    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                        server_public, own.public, own.secret,
                    )  # fmt: skip
                sock.setsockopt(zmq.LINGER, 0)
            push.connect(target["address"])
            pull.connect(target["output_address"])
            rogues.extend((push, pull))
            for frame in frames:
                push.send(frame)  # queued: the handshake never completes, so nothing is delivered
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for sock in rogues[1::2]:
                if sock.poll(50):
                    stolen.append(sock.recv())

    out = _run_streams(cluster, attack)
    assert _texts(out) == expected
    assert stolen == []
    assert cluster.admin()["num_migrations"] == migrations  # nothing was aborted
    wait_until(lambda: cluster.http.get("/v1/admin/stats").json()["num_auth_denied"] > denied, 10, "denials")
    for sock in rogues:
        sock.close()
    ctx.term()


def test_handshakes_failing_before_the_key_check_are_counted(cluster: ClusterServer) -> None:
    """A peer holding another cluster's key (it encrypts to a server key that is not the engine's)
    or none at all (plaintext) fails the CURVE handshake before the ZAP handler is asked: those
    refusals count in ``num_auth_denied`` too, for either socket of the engine."""
    target = cluster.instances()["engine-0"]
    other = ClusterKey.generate()
    ctx = zmq.Context()

    def denied() -> int:
        return cluster.http.get("/v1/admin/stats").json()["num_auth_denied"]

    for key in (other, None):
        for kind, address in ((zmq.PUSH, target["address"]), (zmq.PULL, target["output_address"])):
            before = denied()
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            if key is not None:
                secure_client(sock, key)
            sock.connect(address)
            try:
                wait_until(
                    lambda b=before: denied() > b, 30, f"a refusal at {address} (key: {key is not None})"
                )
            finally:
                sock.close()
    ctx.term()


def test_the_embedded_store_refuses_peers_without_the_key(cluster: ClusterServer) -> None:
    engine_pid = cluster.instances()["engine-0"]["pid"]
    argv = Path(f"/proc/{engine_pid}/cmdline").read_bytes().decode().split("\0")
    bridge = argv[argv.index("--store") + 1].removeprefix("embedded+")
    fake = keys.InstanceRecord(
        name="fake", role="mixed", incarnation="x", input_addr="tcp://127.0.0.1:1", output_addr="tcp://127.0.0.1:2",
        pid=1, info={}, started_at=0.0,
    )  # fmt: skip

    async def forge(key: ClusterKey | None) -> None:
        store = BridgeStoreClient(bridge, key)
        try:
            await store.put("/xllm/instances/fake", keys.encode(fake))
        finally:
            await store.close()

    for key in (None, ClusterKey.generate()):
        with pytest.raises(StoreUnavailableError):
            asyncio.run(forge(key))
    assert "fake" not in cluster.instances()


def _handshaken(sock: zmq.Socket, address: str) -> None:
    """Connect ``sock`` to ``address`` and wait until its CURVE handshake succeeded."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    try:
        assert monitor.poll(int(GUARD_S * 1000)), f"no handshake with {address}"
        recv_monitor_message(monitor)
    finally:
        sock.disable_monitor()
        monitor.close()


def test_a_frozen_engine_is_failed_over_through_its_lease_alone(
    cluster: ClusterServer, expected: list[str]
) -> None:
    """A stopped process (SIGSTOP) lives on: no exit watch sees it, only its silence does (no
    heartbeat for a lease: the registry declares it dead and revokes the lease). Its streams migrate
    and finish with the same tokens; resumed, the same process rejoins as a new incarnation."""
    migrations = cluster.admin()["num_migrations"]
    frozen: list[dict[str, Any]] = []

    def freeze() -> None:
        frozen.append(
            wait_until(lambda: freeze_a_busy_instance(cluster), 60, "an instance frozen with work on it")
        )
        name = frozen[0]["name"]
        wait_until(
            lambda: not cluster.instances().get(name, {}).get("healthy"), GUARD_S, f"{name} declared dead"
        )

    try:
        out = _run_streams(cluster, freeze)
        assert _texts(out) == expected  # migrated, not lost, not repeated
        assert cluster.admin()["num_migrations"] > migrations
    finally:
        for victim in frozen:
            os.kill(victim["pid"], signal.SIGCONT)
    victim = frozen[0]

    def rejoined() -> dict[str, Any] | None:
        now = cluster.instances().get(victim["name"])
        return now if now and now["healthy"] and now["incarnation"] != victim["incarnation"] else None

    assert wait_until(rejoined, GUARD_S, f"{victim['name']} to rejoin")["pid"] == victim["pid"]  # no relaunch


def test_an_engine_side_abort_nobody_asked_for_migrates_the_streams(
    cluster: ClusterServer, expected: list[str], key_file: Path
) -> None:
    """A second service holding the key says hello to engine-0: it aborts our requests there and
    drops their outputs. Our service must not wait on them forever.

    The Hello must reach engine-0 while our streams still run there: its connection is made first,
    and it is sent while engine-0 is frozen (SIGSTOP) with our streams in flight, so they cannot
    finish before the engine reads it."""
    key = read_key_file(key_file)
    target = cluster.instances()["engine-0"]
    migrations = cluster.admin()["num_migrations"]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    secure_client(push, key)
    push.setsockopt(zmq.LINGER, 1000)
    _handshaken(push, target["address"])

    def take_over() -> None:
        wait_until(
            lambda: freeze_a_busy_instance(cluster, lambda i: i["name"] == "engine-0"),
            60,
            "engine-0 frozen with work on it",
        )
        try:
            push.send(msgspec.msgpack.encode(Hello(service_id="another-service")))
        finally:
            os.kill(target["pid"], signal.SIGCONT)

    out = _run_streams(cluster, take_over)
    log = cluster.log_path.read_text(errors="replace")
    assert re.search(r"service another-service connected \(previous: .*\); aborting [1-9]", log), log[-3000:]
    assert _texts(out) == expected  # migrated, not lost, not repeated
    assert cluster.admin()["num_migrations"] > migrations
    push.close()
    ctx.term()
