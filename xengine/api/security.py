"""Authentication of the internal ZMQ planes: ZMQ CURVE with one per-cluster key.

Threat model (``docs/security.md``): anything that can reach an engine's ZMQ ports or the embedded
store's bridge port — another local user, a process of another uid, a host on the network when
``cluster.launch.engine_host`` is not loopback — is untrusted. Processes of the serving user (who can read
the key file, or ptrace the service) and root are trusted.

Every engine binds its command (PULL) and output (PUSH) sockets as CURVE servers, the service's
embedded-store bridge its ROUTER socket likewise, and each runs a ZAP handler that admits only
clients proving possession of the cluster's secret key (CURVE authenticates the client's public key,
and only the cluster key's public half is allowed). A peer without the key never completes the
handshake: it can neither send a frame nor receive one (so it cannot take a share of a PUSH
socket's output either). Traffic is encrypted too.

The key is a CURVE secret key (z85). Its public half is derived from it and never needs to be
published. It comes from, in order: ``XLLM_CLUSTER_KEY`` (how the service hands an ephemeral key
to the engines it launches), or a key file of mode 0600 (``cluster.auth.key_file``; shared by
``xllm engine`` and ``xllm serve`` in attach mode, created on first use).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from xengine.api.envs import CLUSTER_KEY

ENV_KEY = CLUSTER_KEY.name
_HEADER = "xllm-cluster-key-v1"


class ClusterKeyError(ValueError):
    """The cluster key is missing, malformed or not private; the message says what to do."""


@dataclass(frozen=True)
class ClusterKey:
    """A CURVE key pair; ``secret`` is the z85 secret key (40 ASCII bytes)."""

    secret: bytes

    @property
    def public(self) -> bytes:
        return zmq.curve_public(self.secret)

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(zmq.curve_keypair()[1])

    def to_text(self) -> str:
        return f"{_HEADER} {self.secret.decode()}\n"

    @classmethod
    def from_text(cls, text: str, where: str) -> ClusterKey:
        parts = text.split()
        if len(parts) != 2 or parts[0] != _HEADER or len(parts[1]) != 40:
            raise ClusterKeyError(
                f"{where}: not an xllm cluster key (expected '{_HEADER} <40 z85 characters>')"
            )
        try:
            key = cls(parts[1].encode("ascii"))
            key.public  # noqa: B018 - validates the z85 text
        except (UnicodeError, ValueError, zmq.ZMQError) as e:
            raise ClusterKeyError(f"{where}: malformed cluster key ({e})") from None
        return key


def read_key_file(path: str | Path) -> ClusterKey:
    """The key in ``path``; refuses a file that group or others may read or write."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ClusterKeyError(f"cluster key file {str(path)!r} not found") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterKeyError(
            f"cluster key file {str(path)!r} is accessible by group/others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod 600 {path}"
        )
    return ClusterKey.from_text(path.read_text(), str(path))


def write_key_file(path: str | Path, key: ClusterKey) -> bool:
    """Create ``path`` (mode 0600) holding ``key``; False when it already exists (not overwritten)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(key.to_text())
    return True


def load_or_create_key_file(path: str | Path) -> ClusterKey:
    """The key in ``path``, generating one there first when the file does not exist."""
    write_key_file(path, ClusterKey.generate())
    return read_key_file(path)


def take_env_key() -> ClusterKey | None:
    """The key handed over in ``XLLM_CLUSTER_KEY`` (removed from the environment once read)."""
    text = CLUSTER_KEY.pop()
    return None if not text else ClusterKey.from_text(text, ENV_KEY)


def env_with_key(env: dict[str, str], key: ClusterKey | None) -> dict[str, str]:
    """``env`` plus the key for a child engine process (None: unchanged)."""
    return env if key is None else {**env, ENV_KEY: key.to_text().strip()}


def secure_server(sock: zmq.Socket, key: ClusterKey) -> None:
    """Make ``sock`` (before bind) a CURVE server with the cluster key."""
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, key: ClusterKey) -> None:
    """Make ``sock`` (before connect) a CURVE client authenticating with the cluster key."""
    sock.curve_serverkey = key.public
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret


class _AllowClusterKey:
    """ZAP credentials provider: admit exactly the cluster key's public half."""

    def __init__(self, key: ClusterKey) -> None:
        self._public = key.public
        self.num_denied = 0

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = client_key == self._public
        self.num_denied += not ok
        return ok


class _RefusalMonitor:
    """Counts the CURVE handshakes that fail before any ZAP request, which only a socket monitor
    reports: a peer holding another cluster key (it encrypts to the wrong server key:
    ``EVENT_HANDSHAKE_FAILED_PROTOCOL``) or none (plaintext: the same event, or, when the peer saw the
    mechanism mismatch first and hung up, ``EVENT_HANDSHAKE_FAILED_NO_DETAIL``; so does any peer that
    drops the connection mid-handshake). One daemon thread reads the monitors of every watched socket;
    it closes them when stopped."""

    POLL_MS = 100
    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self) -> None:
        self.num_refused = 0
        self._monitors: list[zmq.Socket] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, sock: zmq.Socket) -> None:
        self._monitors.append(sock.get_monitor_socket(self.EVENTS))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="zmq-refusals")
            self._thread.start()

    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        try:
            while not self._stop.is_set():
                poller = zmq.Poller()
                for mon in list(self._monitors):
                    poller.register(mon, zmq.POLLIN)
                for mon, _ in poller.poll(self.POLL_MS):
                    event = recv_monitor_message(mon)
                    self.num_refused += bool(event["event"] & self.EVENTS)
        finally:
            for mon in self._monitors:
                mon.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


class ZapGuard:
    """The ZAP handler of one ZMQ context: admits only cluster-key clients on its CURVE servers."""

    def __init__(self, ctx: zmq.Context, key: ClusterKey) -> None:
        self._check = _AllowClusterKey(key)
        self._refusals = _RefusalMonitor()
        if isinstance(ctx, zmq.asyncio.Context):
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._auth: Any = AsyncioAuthenticator(ctx)
        else:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self._check)

    def watch(self, sock: zmq.Socket) -> None:
        """Also count the handshakes ``sock`` (a CURVE server of this context; not asyncio) refuses
        before the ZAP handler is asked: peers holding another key, plaintext ones, and peers that
        hang up mid-handshake."""
        self._refusals.watch(sock)

    @property
    def num_denied(self) -> int:
        """Handshakes refused so far (peers without the cluster key): refused by the ZAP handler (a
        client key other than the cluster key's), and, on watched sockets, failed before it."""
        return self._check.num_denied + self._refusals.num_refused

    def stop(self) -> None:
        """Stop the handler and the refusal monitor (before the context is terminated)."""
        self._refusals.stop()
        with contextlib.suppress(Exception):
            self._auth.stop()

    async def aclose(self) -> None:
        """``stop`` for an asyncio context, awaiting the authenticator's poll task: pyzmq only cancels
        it, and its clean-up, run later, would unregister a descriptor a new socket may have reused
        (a second keyed store bridge in the same process then never answers)."""
        task = getattr(self._auth, "_AsyncioAuthenticator__task", None)
        self.stop()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
