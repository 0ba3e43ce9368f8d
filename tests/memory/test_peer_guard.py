"""The KV transfer plane admits only this user and root: the bind-host shim's accept guard.

``docs/security.md`` counts other local users as untrusted, and Mooncake authenticates no peer: a
process of uid ``nobody`` could read the registered KV memory through the TCP data port and get
answers from the handshake port. Here:

- the shim's owner lookup (loaded into this process with ctypes, not preloaded, so this process's
  own ``accept()`` stays the real one) names who holds the far end of a loopback connection: this
  process, a forked child running as ``nobody``, nobody once it closed, and "not on this host" for a
  peer in another network namespace;
- ``accept()`` in a child started with the shim skips a ``nobody`` connection queued before this
  user's, fails with EAGAIN when none is left (blocking or not), and leaves listeners bound to an
  explicit address alone;
- a real Mooncake transfer engine started the way a PD engine starts it (a child with the shim
  preloaded for 127.0.0.1) closes ``nobody``'s well-formed requests to both its ports unanswered
  and counts them, while this user's are served and a real KV transfer between two transfer engines
  still works.

Switching to uid ``nobody`` needs root (CI runs as root): those tests skip otherwise.
"""

from __future__ import annotations

import ctypes
import encodings.idna  # noqa: F401  (a child running as nobody may not be able to read the stdlib)
import importlib.util
import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from memory.bind_host import PeerOwner, confined_env, peer_owner, shim_library

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
PORT_RANGE = (23700, 23749)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to uid nobody needs root")
needs_cc = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler"
)
needs_mooncake = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="Mooncake transfer engine not installed"
)


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


class Peer:
    """A forked child running as ``uid`` that connects to ``addr`` (from local port ``port``), sends
    ``payload`` and reads what comes back until the server closes or ``want`` bytes came
    (``answer``), or holds the connection until ``close``. Forked, not executed: the interpreter may
    live where ``uid`` cannot read."""

    def __init__(
        self, uid: int, addr: tuple[str, int], payload: bytes | None = None, want: int | None = None
    ) -> None:
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        ready_r, ready_w = os.pipe()
        self._go_r, self._go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                if uid != os.geteuid():
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                with socket.socket(family) as s:
                    s.connect(addr)
                    os.write(ready_w, struct.pack("!H", s.getsockname()[1]))
                    if payload is None:
                        os.read(self._go_r, 1)
                    else:
                        s.sendall(payload)
                        s.settimeout(60)  # a hang (the guard missing) fails the test, not CI
                        os.write(ready_w, _recv_all(s, want))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            port = ready.read(2)
            self.answer = ready.read() if payload is not None else None
        self.port = struct.unpack("!H", port)[0] if len(port) == 2 else 0
        if not self.port:
            self.close()
            raise AssertionError(f"a child of uid {uid} could not connect to {addr}")
        if payload is not None and self.close() != 0:
            raise AssertionError(f"the child of uid {uid} failed after connecting to {addr}")

    def close(self) -> int:
        """Let the child close its socket and exit; returns its exit code once it has."""
        if self.pid:
            os.write(self._go_w, b"g")
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            os.close(self._go_r)
            os.close(self._go_w)
            self.pid = 0
        return self.returncode


def _recv_all(s: socket.socket, want: int | None) -> bytes:
    got = b""
    try:
        while (want is None or len(got) < want) and (chunk := s.recv(65536)):
            got += chunk
    except ConnectionResetError:  # closed with our request unread: a reset instead of a FIN
        pass
    except TimeoutError:
        got += b"<timed out: the connection was held open>"
    return got


# ---------------------------------------------------------------------------------- owner lookup


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> ctypes.CDLL:
    return ctypes.CDLL(str(shim_library(tmp_path_factory.mktemp("xllm-cache"))))


HOSTS = ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(not _ipv6(), reason="no IPv6"))]


@needs_cc
@needs_root
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("method", ["auto", "diag", "proc"])
def test_owner_of_a_local_peer(shim: ctypes.CDLL, method: str, host: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as listener:
        listener.bind((host, 0))
        listener.listen(4)
        addr = listener.getsockname()[:2]
        with socket.create_connection(addr), listener.accept()[0] as mine:
            assert peer_owner(mine.fileno(), shim, method) == PeerOwner(local=True, uid=os.geteuid())
        other = Peer(NOBODY, addr)
        theirs = listener.accept()[0]
        with theirs:
            assert peer_owner(theirs.fileno(), shim, method) == PeerOwner(local=True, uid=NOBODY)
            other.close()  # its socket is gone: no owner to trust, and still a local peer
            assert peer_owner(theirs.fileno(), shim, method) == PeerOwner(local=True, uid=None)


@pytest.fixture
def other_netns() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (its name, our side's address)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and ip (iproute2)")
    name, veth = f"xllm-pg-{os.getpid()}", f"xpg{os.getpid() % 100000}"
    # a /30 of the benchmarking range 198.18.0.0/15, one per pid (other runs may do the same)
    base = ipaddress.ip_address("198.18.0.0") + 4 * (os.getpid() % 32768)
    ours, theirs = base + 1, base + 2
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name],
        ["ip", "addr", "add", f"{ours}/30", "dev", veth],
        ["ip", "link", "set", veth, "up"],
        ["ip", "-n", name, "addr", "add", f"{theirs}/30", "dev", "eth0"],
        ["ip", "-n", name, "link", "set", "eth0", "up"],
    ]
    try:
        for step in steps:
            res = subprocess.run(step, capture_output=True, text=True)
            if res.returncode != 0:
                pytest.skip(f"cannot build a network namespace here ({' '.join(step)}: {res.stderr.strip()})")
        yield name, str(ours)
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_cc
def test_a_peer_in_another_network_namespace_cannot_be_checked(shim: ctypes.CDLL, other_netns) -> None:
    name, host = other_netns
    with socket.socket() as listener:
        listener.bind((host, 0))
        listener.listen(1)
        code = (
            f"import socket, sys; s = socket.create_connection({listener.getsockname()!r}); sys.stdin.read()"
        )
        child = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-c", code], stdin=subprocess.PIPE
        )
        try:
            conn, (peer, _) = listener.accept()
            with conn:
                assert peer != host  # it comes from the other namespace's address
                for method in ("auto", "diag", "proc"):
                    assert peer_owner(conn.fileno(), shim, method) == PeerOwner(local=False)
        finally:
            child.stdin.close()
            child.wait(timeout=30)


# ------------------------------------------------------------------------- accept() with the shim

_ACCEPTOR = r"""
import errno, json, socket, sys
from memory.bind_host import num_refused
listeners = []
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "listen":  # on the wildcard (moved to XLLM_BIND_HOST, guarded) or on an explicit host
        s = socket.socket()
        s.bind(("0.0.0.0" if args[0] == "wildcard" else "127.0.0.1", 0))
        s.listen(8)
        listeners.append(s)
        out = {"addr": s.getsockname()}
    elif cmd == "accept":
        s = listeners[int(args[0])]
        s.setblocking(args[1] == "blocking")
        try:
            conn, peer = s.accept()
            out = {"peer_port": peer[1]}
            conn.close()
        except OSError as e:
            out = {"error": errno.errorcode[e.errno]}
    out["refused"] = num_refused()
    print(json.dumps(out), flush=True)
"""


class Acceptor:
    """A child process started with the shim (as a PD engine is) that listens and accepts on command."""

    def __init__(self) -> None:
        env = confined_env("127.0.0.1", {k: v for k, v in os.environ.items() if not k.startswith("MC_")})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ACCEPTOR],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def __call__(self, *cmd: str) -> dict:
        self.proc.stdin.write(" ".join(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@needs_cc
@needs_root
def test_accept_skips_other_users_and_never_blocks_past_them() -> None:
    acceptor = Acceptor()
    held: list[Peer] = []
    try:
        guarded = tuple(acceptor("listen", "wildcard")["addr"])
        assert guarded[0] == "127.0.0.1"  # the bind shim moved it
        # nobody's connection is queued first; accept() closes it and returns this user's, behind it
        held.append(Peer(NOBODY, guarded))
        with socket.create_connection(guarded) as mine:
            got = acceptor("accept", "0", "blocking")
            assert got == {"peer_port": mine.getsockname()[1], "refused": 1}
        # a refusal with nothing behind it: EAGAIN, blocking listener or not, rather than a wait
        for mode, refused in (("blocking", 2), ("nonblocking", 3)):
            held.append(Peer(NOBODY, guarded))
            assert acceptor("accept", "0", mode) == {"error": "EAGAIN", "refused": refused}
        # a listener bound to an explicit address is not the transfer plane's: untouched
        explicit = tuple(acceptor("listen", "explicit")["addr"])
        held.append(Peer(NOBODY, explicit))
        assert acceptor("accept", "1", "blocking") == {"peer_port": held[-1].port, "refused": 3}
    finally:
        for peer in held:
            peer.close()
        acceptor.close()


# ---------------------------------------------------------------------- a real Mooncake transfer engine

_AGENT = r"""
import json, sys
import torch
from memory.transfer import KVRegion, KVTransferAgent

role, port_range, host, strict = sys.argv[1], tuple(json.loads(sys.argv[2])), sys.argv[3], sys.argv[4] == "1"

def kv_caches(fill):
    # 2 layers of [2, num_blocks=8, block_size=4, heads=2, head_dim=8]
    t = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
    if fill:
        for i, x in enumerate(t):
            x.copy_(torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape) + 1000 * i)
    return t

def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

caches = kv_caches(role == "server")
agent = KVTransferAgent(caches, host, port_range=port_range, strict_bind=strict)
r = agent.region
emit(session=r.session, layer_addrs=r.layer_addrs, num_blocks=r.num_blocks, block_bytes=r.block_bytes,
     listen_addrs=agent.listen_addrs, peer_guard=agent.peer_guard)
if role == "client":
    peer = KVRegion(**json.loads(sys.stdin.readline()))
    pairs = [(1, 0), (2, 1), (5, 6)]
    agent.read_blocks(peer, pairs)
    ok = all(
        torch.equal(mine[kv, d], ref[kv, s])
        for mine, ref in zip(caches, kv_caches(True)) for kv in (0, 1) for s, d in pairs
    )
    emit(ok=ok, refused=agent.num_peers_refused)
for _ in sys.stdin:  # a line: report the count of refused connections; end of input: exit
    emit(refused=agent.num_peers_refused)
"""


class Agent:
    """A KV transfer agent for ``host`` in a child process started with the shim for that host, as a
    PD engine's (``confined`` False: without it); its stderr goes to ``log``."""

    def __init__(self, role: str, log: Path, host: str = "127.0.0.1", confined: bool = True) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
        env = confined_env(host, env) if confined else env
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _AGENT, role, json.dumps(PORT_RANGE), host, str(int(confined))],
            cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        )  # fmt: skip
        self.info = self.result()
        self.session_port = int(self.info["session"].rsplit(":", 1)[1])
        self.data_port = next(p for _, p in self.info["listen_addrs"] if p != self.session_port)

    def result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        self.proc.wait(timeout=30)
        raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def refused(self) -> int:
        self.send("count")
        return self.result()["refused"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Agent]:
    agent = Agent("server", tmp_path_factory.mktemp("agents") / "server.log")
    yield agent
    agent.close()


def _read_request(addr: int, size: int) -> bytes:
    """A TCP data-port request (Mooncake's ``SessionHeader``: size, address, opcode READ) for
    ``size`` bytes of the server's memory at ``addr``."""
    return struct.pack("<QQB7x", size, addr, 0)


def _handshake_request() -> bytes:
    """A handshake-port request: a length-prefixed JSON message (Mooncake answers with its own)."""
    return struct.pack("<Q", 2) + b"{}"


# layer 0's first 16 values (floats 0..15): what a READ of 64 bytes at its base returns
FIRST_BYTES = struct.pack("<16f", *range(16))


@needs_cc
@needs_root
@needs_mooncake
def test_other_users_requests_are_closed_unanswered_and_counted(server: Agent) -> None:
    assert server.info["peer_guard"] is True
    before = server.refused()
    data = Peer(NOBODY, ("127.0.0.1", server.data_port), _read_request(server.info["layer_addrs"][0], 64), 64)
    handshake = Peer(NOBODY, ("127.0.0.1", server.session_port), _handshake_request())
    assert data.answer == b"" and handshake.answer == b""  # not one byte of KV memory, no handshake
    assert server.refused() == before + 2
    log = server.log.read_text()
    for port in (server.data_port, server.session_port):
        assert f"closed a connection to port {port} " in log and "belongs to uid 65534" in log


@needs_cc
@needs_mooncake
def test_this_users_requests_are_served(server: Agent) -> None:
    before = server.refused()
    data = Peer(
        os.geteuid(), ("127.0.0.1", server.data_port), _read_request(server.info["layer_addrs"][0], 64), 64
    )
    handshake = Peer(os.geteuid(), ("127.0.0.1", server.session_port), _handshake_request())
    assert data.answer == FIRST_BYTES
    length = struct.unpack("<Q", handshake.answer[:8])[0]  # then Mooncake's JSON, as much
    assert length == len(handshake.answer) - 8 and json.loads(handshake.answer[8:])
    assert server.refused() == before


@needs_cc
@needs_mooncake
def test_kv_transfer_between_two_guarded_engines(server: Agent, tmp_path: Path) -> None:
    before = server.refused()
    client = Agent("client", tmp_path / "client.log")
    try:
        assert client.info["peer_guard"] is True
        region = {k: server.info[k] for k in ("session", "layer_addrs", "num_blocks", "block_bytes")}
        client.send(json.dumps(region))
        assert client.result() == {"ok": True, "refused": 0}
    finally:
        client.close()
    assert server.refused() == before


@needs_cc
@needs_mooncake
def test_an_agent_without_the_shim_warns_that_every_local_user_gets_in(tmp_path: Path) -> None:
    agent = Agent("server", tmp_path / "bare.log", confined=False)
    try:
        assert agent.info["peer_guard"] is False and agent.refused() == 0
    finally:
        agent.close()
    assert "admits every local user on ports" in agent.log.read_text()


_REMOTE_READ = r"""
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    s.sendall(bytes.fromhex(sys.argv[3]))
    got = b""
    while len(got) < 64 and (chunk := s.recv(64 - len(got))):
        got += chunk
print(got.hex())
"""


@needs_cc
@needs_root
@needs_mooncake
def test_a_routable_host_warns_refuses_local_users_and_serves_remote_peers(
    other_netns, tmp_path: Path
) -> None:
    name, host = other_netns
    agent = Agent("server", tmp_path / "routable.log", host=host)
    try:
        assert agent.info["peer_guard"] is True
        request = _read_request(agent.info["layer_addrs"][0], 64)
        # another local user reaching the routable address: closed as on loopback
        assert Peer(NOBODY, (host, agent.data_port), request, 64).answer == b""
        # a peer in another network namespace, as a PD engine on another host would be: no socket
        # here to tell its owner, so it is served (multi-node PD keeps working; see docs/security.md)
        argv = [sys.executable, "-c", _REMOTE_READ, host, str(agent.data_port), request.hex()]
        remote = subprocess.run(
            ["ip", "netns", "exec", name, *argv], capture_output=True, text=True, timeout=60
        )
        assert bytes.fromhex(remote.stdout.strip()) == FIRST_BYTES, remote.stderr
        assert agent.refused() == 1
    finally:
        agent.close()
    assert f"listens on {host}, which is not loopback" in agent.log.read_text()
