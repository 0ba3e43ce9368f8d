"""The bind-host shim (``memory/bind_host``): built once, and in a process started with it, wildcard
binds land on ``XLLM_BIND_HOST`` while every other bind is untouched.

Each case runs a fresh child Python with ``confined_env``'s environment (what an engine process
re-executes itself with) that binds plain sockets and reports where they landed or the errno.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from memory.bind_host import ENV_HOST, confined_env, exec_env, host_literal, shim_library, shim_loaded

needs_cc = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler"
)

_CHILD = r"""
import errno, json, socket, sys

def bind(family, addr, v6only=None):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        if v6only is not None:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        s.bind((addr, 0))
        s.listen()
        return s.getsockname()[0]
    except OSError as e:
        return errno.errorcode[e.errno]
    finally:
        s.close()

from memory.bind_host import shim_loaded
cases = json.loads(sys.argv[1])
print(json.dumps({"loaded": shim_loaded(), "binds": [bind(*c) for c in cases]}))
"""
V4, V6 = socket.AF_INET, socket.AF_INET6


def _ipv6() -> bool:
    try:
        with socket.socket(V6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6(), reason="no IPv6 loopback")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xllm-cache")


def _run(host: str | None, cases: list[tuple], cache: Path) -> dict:
    env = dict(os.environ)
    if host is not None:
        env = confined_env(host, env, cache)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@needs_cc
def test_built_once_into_the_cache_dir(cache: Path) -> None:
    lib = shim_library(cache)
    assert lib.parent == cache / "build" and lib.name.startswith("bind_host-") and lib.suffix == ".so"
    mtime = lib.stat().st_mtime_ns
    assert shim_library(cache) == lib and lib.stat().st_mtime_ns == mtime  # cached, not rebuilt
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temporary file left


@needs_cc
def test_ipv4_host_takes_the_wildcard_binds(cache: Path) -> None:
    res = _run("127.0.0.1", [(V4, "0.0.0.0"), (V4, "127.0.0.2"), (V4, "")], cache)
    assert res == {"loaded": True, "binds": ["127.0.0.1", "127.0.0.2", "127.0.0.1"]}


@needs_cc
@needs_ipv6
def test_ipv6_sockets_with_an_ipv4_host(cache: Path) -> None:
    res = _run("127.0.0.1", [(V6, "::", False), (V6, "::1"), (V6, "::", True)], cache)
    # dual-stack: the v4-mapped host; an IPv6-only socket cannot listen on an IPv4 host: refused
    assert res["binds"] == ["::ffff:127.0.0.1", "::1", "EINVAL"]


@needs_cc
@needs_ipv6
def test_ipv6_host(cache: Path) -> None:
    res = _run("::1", [(V6, "::", False), (V4, "0.0.0.0"), (V4, "127.0.0.1")], cache)
    # an IPv4 socket cannot listen on an IPv6 host: its wildcard bind is refused, not left exposed
    assert res["binds"] == ["::1", "EADDRNOTAVAIL", "127.0.0.1"]


@needs_cc
def test_wildcard_host_and_no_shim_change_nothing(cache: Path) -> None:
    # a wildcard host keeps the binds where they are (the shim is still loaded: its accept guard)
    assert _run("0.0.0.0", [(V4, "0.0.0.0")], cache) == {"loaded": True, "binds": ["0.0.0.0"]}
    assert _run(None, [(V4, "0.0.0.0")], cache) == {"loaded": False, "binds": ["0.0.0.0"]}


@needs_cc
def test_exec_env(cache: Path) -> None:
    lib = str(shim_library(cache))
    env = exec_env("localhost", {"LD_PRELOAD": "/x/other.so", "PATH": "/bin"}, cache)
    assert env == {"LD_PRELOAD": f"{lib}:/x/other.so", "PATH": "/bin", ENV_HOST: "127.0.0.1"}
    # a wildcard host still re-executes: the accept guard keeps other local users out
    assert exec_env("0.0.0.0", {}, cache) == {"LD_PRELOAD": lib, ENV_HOST: "0.0.0.0"}
    assert exec_env("::", {}, cache) == {"LD_PRELOAD": lib, ENV_HOST: "::"}
    assert not shim_loaded()  # this test process runs without it...
    with pytest.raises(RuntimeError, match="was not loaded"):  # ...so executing again would loop
        exec_env("127.0.0.1", env, cache)


def test_host_literal() -> None:
    assert host_literal("127.0.0.1") == "127.0.0.1"
    assert host_literal("::ffff:127.0.0.1") == "127.0.0.1"
    assert host_literal("localhost") == "127.0.0.1"
    with pytest.raises(ValueError, match="cannot resolve"):
        host_literal("no-such-host.invalid")
