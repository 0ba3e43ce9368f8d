"""The cluster key (``xengine/api/security.py``): private files only, and CURVE admits only its holders."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq

from xengine.api.security import (
    ENV_KEY,
    ClusterKey,
    ClusterKeyError,
    ZapGuard,
    env_with_key,
    load_or_create_key_file,
    read_key_file,
    secure_client,
    secure_server,
    take_env_key,
)


def test_key_file_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "cluster.key"
    key = load_or_create_key_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_key_file(path) == key  # never overwritten
    assert read_key_file(path).public == key.public


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    load_or_create_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ClusterKeyError, match="chmod 600"):
        read_key_file(path)


@pytest.mark.parametrize(
    "text", ["", "xllm-cluster-key-v1", "xllm-cluster-key-v1 short", "other " + "a" * 40]
)
def test_malformed_keys_are_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "cluster.key"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(ClusterKeyError):
        read_key_file(path)


def test_the_env_key_is_taken_once(monkeypatch: pytest.MonkeyPatch) -> None:
    key = ClusterKey.generate()
    monkeypatch.setattr(os, "environ", env_with_key(dict(os.environ), key))
    assert take_env_key() == key
    assert ENV_KEY not in os.environ and take_env_key() is None


def test_only_cluster_key_holders_get_through() -> None:
    key = ClusterKey.generate()
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    guard = ZapGuard(server_ctx, key)
    pull = server_ctx.socket(zmq.PULL)
    secure_server(pull, key)
    pull.bind("tcp://127.0.0.1:0")
    addr = pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    senders = {}
    for name in ("holder", "plain", "own-key"):
        sock = senders[name] = client_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if name == "holder":
            secure_client(sock, key)
        elif name == "own-key":
            other = ClusterKey.generate()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                key.public,
                other.public,
                other.secret,
            )
        sock.connect(addr)
        sock.send(name.encode())
    received = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if pull.poll(100):
            received.append(pull.recv())
    assert received == [b"holder"]
    assert guard.num_denied >= 1  # the peer with its own key; the plain one fails the mechanism itself
    for sock in [*senders.values(), pull]:
        sock.close()
    guard.stop()
    server_ctx.term()
    client_ctx.term()
