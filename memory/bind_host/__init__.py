"""Confine a process's wildcard binds to one host and its listeners to this user, with a preloaded
``bind()`` / ``accept()`` shim (Linux).

The Mooncake transfer engine binds its listeners to the wildcard address whatever host it is given
and authenticates no peer (``memory/transfer.py``). ``bind_host.c`` moves wildcard binds onto
``XLLM_BIND_HOST``; ``peer_guard.c`` closes, before the library reads a byte, a connection whose
peer socket is on this host and owned by another uid (``peer_owner.c``: how owners are found). The
loader reads ``LD_PRELOAD`` only at program start, so a process confines itself by re-executing with
``exec_env``'s environment. Built from the C files on first use into ``<cache dir>/build/``.
See ``docs/security.md``, "Mooncake binds".
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ops.native_build import build_shared_library
from xengine.api.envs import BIND_HOST

ENV_HOST = BIND_HOST.name
SOURCE = Path(__file__).with_name("bind_host.c")
# compiled and linked with SOURCE into the one library (the C compiler takes them among the libraries)
_OTHER_SOURCES = [SOURCE.with_name("peer_guard.c"), SOURCE.with_name("peer_owner.c")]
_MARKER = "xllm_bind_host_shim"  # a symbol the shim exports
_LOOKUPS = {"auto": 0, "diag": 1, "proc": 2}  # LOOKUP_* in peer_owner.c


def shim_library(cache_dir: Path | None = None) -> Path:
    """The shim's shared library, built on first use (concurrent builders are safe)."""
    purpose = (
        "the bind-host shim that keeps the KV transfer listeners on the configured host and to this "
        f"user (it compiles {SOURCE} and its neighbours)"
    )
    libs = [str(p) for p in _OTHER_SOURCES] + ["-ldl", "-lpthread"]
    return build_shared_library(
        SOURCE, ["-O2", "-Wall"], purpose, cache_dir, libs=libs, depends=_OTHER_SOURCES
    )


def host_literal(host: str) -> str:
    """``host`` as the address literal the shim binds to (a name resolves, IPv4 preferred)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as e:
            raise ValueError(f"invalid value for 'host': cannot resolve {host!r} ({e})") from e
        infos.sort(key=lambda a: a[0] != socket.AF_INET)
        ip = ipaddress.ip_address(infos[0][4][0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _preloaded() -> ctypes.CDLL | None:
    lib = ctypes.CDLL(None)
    return lib if hasattr(lib, _MARKER) else None


def shim_loaded() -> bool:
    """Whether this process runs with the shim preloaded."""
    return _preloaded() is not None


def num_refused() -> int | None:
    """Connections the shim's accept guard has closed in this process (None: no shim)."""
    lib = _preloaded()
    return None if lib is None else ctypes.c_ulong.in_dll(lib, "xllm_peers_refused").value


def listener_guarded(inode: int) -> bool:
    """Whether the listening socket with this inode (``/proc/net/tcp``'s) admits only this user's
    and root's local peers: it was bound from a wildcard address in a process with the shim."""
    lib = _preloaded()
    if lib is None:
        return False
    lib.xllm_listener_guarded.argtypes = [ctypes.c_ulong]
    return bool(lib.xllm_listener_guarded(inode))


@dataclass(frozen=True)
class PeerOwner:
    """Who owns the other end of a TCP connection: ``uid`` when that end is a live socket on this
    host; ``local`` False when it is on another host (it cannot be checked); neither: a local end
    whose socket is gone or cannot be found."""

    local: bool
    uid: int | None = None


def peer_owner(fd: int, lib: ctypes.CDLL | None = None, method: str = "auto") -> PeerOwner:
    """The owner of the peer of the connected TCP socket ``fd``, as the accept guard sees it.

    ``lib``: the shim (default: the preloaded one); ``method``: ``auto`` (sock_diag netlink, else
    ``/proc/net/tcp``), or ``diag`` / ``proc`` alone (to test each)."""
    lib = lib if lib is not None else _preloaded()
    if lib is None:
        raise RuntimeError("the bind-host shim is not loaded")
    uid = ctypes.c_uint(0)
    lib.xllm_peer_owner.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint)]
    found = lib.xllm_peer_owner(fd, _LOOKUPS[method], ctypes.byref(uid))
    return PeerOwner(local=True, uid=uid.value) if found == 1 else PeerOwner(local=found != 0)


def owner_lookup_problem() -> str | None:
    """None when the guard can tell who owns a local peer here (it finds this process's own loopback
    connection); else why not, for it would refuse every local peer, this user's engines included."""
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client.connect(server.getsockname())
        conn, _ = server.accept()
        with conn:
            owner = peer_owner(conn.fileno())
    if owner.uid == os.geteuid():
        return None
    return (
        f"the owner of a loopback connection from this very process reads as {owner} "
        "(neither the sock_diag netlink interface nor /proc/net/tcp answers)"
    )


def confined_env(host: str, env: Mapping[str, str], cache_dir: Path | None = None) -> dict[str, str]:
    """``env`` for a program whose wildcard binds must land on ``host``: the shim first in
    ``LD_PRELOAD`` and ``XLLM_BIND_HOST`` set."""
    lib = str(shim_library(cache_dir))
    preload = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != lib]
    return {**env, "LD_PRELOAD": ":".join([lib, *preload]), ENV_HOST: host_literal(host)}


def exec_env(host: str, env: Mapping[str, str], cache_dir: Path | None = None) -> dict[str, str] | None:
    """The environment to re-execute this process with so its wildcard binds land on ``host`` and its
    wildcard listeners admit only this user's local peers; None when it already runs that way. (A
    wildcard ``host`` keeps the binds where they are; the accept guard still applies.)"""
    literal = host_literal(host)
    if BIND_HOST.get(env) == literal and shim_loaded():
        return None
    new = confined_env(host, env, cache_dir)
    if BIND_HOST.get(env) == literal and env.get("LD_PRELOAD") == new["LD_PRELOAD"]:
        # already re-executed with it, yet the loader did not preload it: executing again would loop
        raise RuntimeError(
            f"LD_PRELOAD={new['LD_PRELOAD']} was not loaded (see the loader's message above); the "
            "KV transfer listeners would bind the wildcard address"
        )
    return new
