"""Where a KV transfer agent's Mooncake engine listens, and that a transfer works on loopback.

Mooncake reads its port range once per process, when ``mooncake.engine`` is loaded, and other test
modules load it at collection; so every agent here lives in a fresh child process: a "server" that
registers a KV tensor holding a known pattern and a "client" that reads blocks of it. Each child
reports its agent's ``listen_addrs`` and ``ss -ltnp`` for its own pid.

Mooncake (0.3.13) binds its handshake listener to ``0.0.0.0`` and its TCP data listener to ``[::]``
whatever host it is given, with no option to change it; so the server and client children run with
the ``memory.bind_host`` shim preloaded for 127.0.0.1 (``confined_env``, what a PD engine process
re-executes itself with), which moves both listeners onto loopback (``127.0.0.1`` and
``[::ffff:127.0.0.1]``); the "strict" child runs without it and sees the wildcard binds refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memory.bind_host import confined_env
from memory.transfer import check_port_range
from xengine.api.config import CacheConfig

ROOT = Path(__file__).resolve().parents[2]
PORT_RANGE = (23100, 23299)
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

needs_mooncake = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="Mooncake transfer engine not installed"
)

_CHILD = r"""
import json, os, shutil, subprocess, sys
import torch
from memory.transfer import KVRegion, KVTransferAgent

role, port_range = sys.argv[1], tuple(json.loads(sys.argv[2]))

def kv_caches(fill):
    # 2 layers of [2, num_blocks=8, block_size=4, heads=2, head_dim=8]
    t = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
    if fill:
        for i, x in enumerate(t):
            x.copy_(torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape) + 1000 * i)
    return t

def ss():
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]

def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

if role == "server":
    caches = kv_caches(True)
    agent = KVTransferAgent(caches, port_range=port_range, strict_bind=True)
    r = agent.region
    emit(session=r.session, layer_addrs=r.layer_addrs, num_blocks=r.num_blocks, block_bytes=r.block_bytes,
         listen_addrs=agent.listen_addrs, ss=ss())
    sys.stdin.readline()
elif role == "client":
    peer = KVRegion(**json.loads(sys.stdin.readline()))
    caches = kv_caches(False)
    agent = KVTransferAgent(caches, port_range=port_range, strict_bind=True)
    pairs = [(1, 0), (2, 1), (5, 6)]
    stats = agent.read_blocks(peer, pairs)
    ok = all(
        torch.equal(mine[kv, d], ref[kv, s])
        for mine, ref in zip(caches, kv_caches(True)) for kv in (0, 1) for s, d in pairs
    )
    untouched = all(torch.count_nonzero(c[:, [2, 3, 4, 5, 7]]) == 0 for c in caches)
    emit(ok=ok, untouched=untouched, num_bytes=stats.num_bytes, num_ranges=stats.num_ranges,
         session=agent.region.session, listen_addrs=agent.listen_addrs, ss=ss())
elif role == "strict":
    from memory.transfer import _proc_listeners
    try:
        KVTransferAgent(kv_caches(False), port_range=port_range, strict_bind=True)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    try:
        KVTransferAgent(kv_caches(False), port_range=(port_range[0] + 1, port_range[1]))
        other_range = None
    except RuntimeError as e:
        other_range = str(e)
    emit(raised=raised, other_range=other_range, left=sorted(_proc_listeners().values()), ss=ss())
"""


def _spawn(role: str, confined: bool = True) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    if confined:
        env = confined_env("127.0.0.1", env)
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, role, json.dumps(PORT_RANGE)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    proc.wait(timeout=30)
    raise AssertionError(f"child exited with {proc.returncode} before reporting")


@pytest.fixture(scope="module")
def pair() -> tuple[dict, dict]:
    server = _spawn("server")
    client = None
    try:
        srv = _result(server)
        client = _spawn("client")
        region = {k: srv[k] for k in ("session", "layer_addrs", "num_blocks", "block_bytes")}
        client.stdin.write(json.dumps(region) + "\n")
        client.stdin.flush()
        cli = _result(client)
        return srv, cli
    finally:
        for p in (client, server):
            if p is not None:
                try:
                    p.stdin.write("\n")
                    p.stdin.close()
                except (BrokenPipeError, ValueError):
                    pass
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def _host(addr: str) -> str:
    return re.sub(r"^\[|\]$", "", addr.rsplit(":", 1)[0])


def _ss_form(a: str, p: int) -> str:
    return (
        f"0.0.0.0:{p}"
        if a == "0.0.0.0"
        else f"*:{p}"
        if a == "::"
        else f"[{a}]:{p}"
        if ":" in a
        else f"{a}:{p}"
    )


@needs_mooncake
def test_transfer_between_two_processes_on_loopback(pair) -> None:
    _, cli = pair
    assert cli["ok"] and cli["untouched"]
    # 2 layers x K/V x runs {1,2}->{0,1} and {5}->{6}; a block is 4 * 2 * 8 float32
    assert cli["num_ranges"] == 8 and cli["num_bytes"] == 2 * 2 * 3 * 4 * 2 * 8 * 4


@needs_mooncake
def test_both_listeners_reported_and_within_port_range(pair) -> None:
    lo, hi = PORT_RANGE
    for res in pair:
        assert _host(res["session"]) == "127.0.0.1"
        addrs = res["listen_addrs"]
        assert addrs is not None and len(addrs) == 2  # handshake/RPC + TCP data
        assert _port(res["session"]) in {p for _, p in addrs}
        assert all(lo <= p <= hi for _, p in addrs)
        if res["ss"] is not None:  # the process listens on exactly these, as ss sees it
            assert sorted(res["ss"]) == sorted(_ss_form(a, p) for a, p in addrs)


@needs_mooncake
def test_nothing_listens_outside_loopback(pair) -> None:
    lo, hi = PORT_RANGE
    for res in pair:
        listening = res["ss"] if res["ss"] is not None else [_ss_form(a, p) for a, p in res["listen_addrs"]]
        assert len(listening) == 2 and all(_host(a) in LOOPBACK for a in listening), listening
        assert all(lo <= _port(a) <= hi for a in listening), listening


@needs_mooncake
def test_strict_bind_and_process_wide_port_range() -> None:
    proc = _spawn("strict", confined=False)
    try:
        res = _result(proc)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    # Without the shim Mooncake listens on the wildcard address: refused (and closed). With it (the
    # pair fixture's children), strict_bind accepts.
    assert res["raised"] is not None and "listens on" in res["raised"]
    # The range is fixed when Mooncake loads: another one in the same process is refused.
    assert res["other_range"] is not None and "read once per process" in res["other_range"]
    assert res["left"] == [] and res["ss"] in (None, [])


BAD_RANGES = [(40000, 40099), (24000, 24000), (17000, 15000), (80, 2000), (30000, 33000), (60000, 61000)]


@pytest.mark.parametrize("bad", BAD_RANGES)
def test_port_range_rejects_what_mooncake_would_ignore(bad) -> None:
    with pytest.raises(ValueError, match="port_range"):
        check_port_range(bad)
    assert check_port_range(PORT_RANGE) == PORT_RANGE


@pytest.mark.parametrize("text", [f"{lo}-{hi}" for lo, hi in BAD_RANGES] + ["20000", "a-b", "1-2-3", "-5-10"])
def test_cache_config_port_range_has_the_same_rules(text: str) -> None:
    with pytest.raises(ValueError, match="cache.kv_transfer_port_range"):
        CacheConfig(kv_transfer_port_range=text).validate()
    assert CacheConfig(kv_transfer_port_range="{}-{}".format(*PORT_RANGE)).transfer_ports() == PORT_RANGE
    assert CacheConfig(kv_transfer_port_range=" 61000-65535 ").transfer_ports() == (61000, 65535)
    assert CacheConfig().transfer_ports() is None
