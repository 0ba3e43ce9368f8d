"""Confine a process's wildcard binds to one host with a preloaded ``bind()`` shim (Linux).

The Mooncake transfer engine binds its handshake listener to ``0.0.0.0`` and its TCP data listener
to ``[::]`` whatever host it is given (see ``memory/transfer.py``), and anyone reaching them can read
and write the registered KV memory. ``bind_host.c`` defines ``bind()``: with ``XLLM_BIND_HOST`` set
to an address literal, a bind of the IPv4 or IPv6 wildcard goes to that address instead (same port;
an IPv6 socket gets the v4-mapped form of an IPv4 host; an IPv4 socket cannot take an IPv6 host
and its wildcard bind is refused). The dynamic loader reads ``LD_PRELOAD`` only when a program
starts, so a process confines itself by re-executing with ``exec_env``'s environment.

The shim is built from that C file with the machine's C compiler on first use, into
``<cache dir>/build/`` under a name keyed by the source's hash.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
from collections.abc import Mapping
from pathlib import Path

from ops.native_build import build_shared_library

ENV_HOST = "XLLM_BIND_HOST"
SOURCE = Path(__file__).with_name("bind_host.c")
_MARKER = "xllm_bind_host_shim"  # a symbol the shim exports


def shim_library(cache_dir: Path | None = None) -> Path:
    """The shim's shared library, built on first use (concurrent builders are safe)."""
    purpose = (
        "the bind-host shim that keeps the KV transfer listeners on the configured host "
        f"(it compiles {SOURCE})"
    )
    return build_shared_library(SOURCE, ["-O2", "-Wall"], purpose, cache_dir, libs=["-ldl"])


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


def is_wildcard(literal: str) -> bool:
    return ipaddress.ip_address(literal).is_unspecified


def shim_loaded() -> bool:
    """Whether this process runs with the shim preloaded."""
    return hasattr(ctypes.CDLL(None), _MARKER)


def confined_env(host: str, env: Mapping[str, str], cache_dir: Path | None = None) -> dict[str, str]:
    """``env`` for a program whose wildcard binds must land on ``host``: the shim first in
    ``LD_PRELOAD`` and ``XLLM_BIND_HOST`` set."""
    lib = str(shim_library(cache_dir))
    preload = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != lib]
    return {**env, "LD_PRELOAD": ":".join([lib, *preload]), ENV_HOST: host_literal(host)}


def exec_env(host: str, env: Mapping[str, str], cache_dir: Path | None = None) -> dict[str, str] | None:
    """The environment to re-execute this process with so its wildcard binds land on ``host``;
    None when it already runs that way, or when ``host`` is itself a wildcard."""
    literal = host_literal(host)
    if is_wildcard(literal):
        return None
    if env.get(ENV_HOST) == literal and shim_loaded():
        return None
    new = confined_env(host, env, cache_dir)
    if env.get(ENV_HOST) == literal and env.get("LD_PRELOAD") == new["LD_PRELOAD"]:
        # already re-executed with it, yet the loader did not preload it: executing again would loop
        raise RuntimeError(
            f"LD_PRELOAD={new['LD_PRELOAD']} was not loaded (see the loader's message above); the "
            "KV transfer listeners would bind the wildcard address"
        )
    return new
