"""KV transfer between engine instances over the Mooncake transfer engine (PD disaggregation).

``KVTransferAgent`` registers every layer's KV tensor (``PagedKVLayout``'s: one contiguous
``[2, num_blocks, block_size, heads, row]`` tensor a layer; an 8-bit cache's rows carry their scales, so
its blocks move as they are) with a Mooncake ``TransferEngine``
once, then pulls whole blocks from a peer (its session, ``host:rpc_port``; ``P2PHANDSHAKE`` mode, no
metadata server) with batched one-sided reads, runs of consecutive blocks coalesced into one range.
TCP on CPU; RDMA / HCCS use the same calls. Mooncake authenticates no peer and binds its listeners to
the wildcard address, so ``port_range``, ``listen_addrs``, ``strict_bind`` and ``peer_guard`` keep its
ports where the ``memory.bind_host`` shim confines them (``docs/security.md``, "Mooncake binds").
``mooncake`` is imported only when an agent is created.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch

from memory import bind_host

logger = logging.getLogger("memory.transfer")

PROTOCOL = "tcp"
METADATA_MODE = "P2PHANDSHAKE"

# Mooncake's own checks on MC_MIN_RPC_PORT / MC_MAX_RPC_PORT (config.cpp ValidatePortRange): a range
# outside these is silently replaced by its default [15000, 17000]. Each engine takes two ports.
_PORT_MIN, _PORT_MAX = 1024, 65535
_EPHEMERAL = (32768, 60999)
_MOONCAKE_MODULE = "mooncake.engine"


@dataclass(frozen=True)
class KVRegion:
    """Where one instance's registered KV memory is, as a peer needs it to read blocks."""

    session: str  # "host:rpc_port" of its transfer engine
    layer_addrs: list[int]  # base address of each layer's KV tensor
    num_blocks: int
    block_bytes: int  # bytes of one block of K (or of V) in one layer


@dataclass(frozen=True)
class TransferStats:
    num_blocks: int
    num_bytes: int
    num_ranges: int
    seconds: float


def block_ranges(
    src: KVRegion, dst: KVRegion, pairs: list[tuple[int, int]]
) -> tuple[list[int], list[int], list[int]]:
    """(src addrs, dst addrs, lengths) covering every layer's K and V of the ``(src, dst)`` block pairs.

    Pairs whose source and destination ids both continue the previous run merge into one range.
    """
    if src.block_bytes != dst.block_bytes or len(src.layer_addrs) != len(dst.layer_addrs):
        raise ValueError("KV layouts differ between the two instances")
    runs: list[list[int]] = []  # [src first, dst first, count]
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    bb = src.block_bytes
    src_addrs, dst_addrs, lengths = [], [], []
    for src_base, dst_base in zip(src.layer_addrs, dst.layer_addrs):
        for kv in (0, 1):
            for s, d, n in runs:
                src_addrs.append(src_base + (kv * src.num_blocks + s) * bb)
                dst_addrs.append(dst_base + (kv * dst.num_blocks + d) * bb)
                lengths.append(n * bb)
    return src_addrs, dst_addrs, lengths


class ExtraKV:
    """Paged KV tensors beside an agent's own (``[2, num_blocks, block_size, H, D]`` per layer: a
    sliding-window pool, a draft head's pool) that peers read blocks of: registered with the agent on
    first use, described as a region of their own."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.addrs: list[int] = []

    def register(self, agent: KVTransferAgent) -> None:
        if not self.addrs:
            self.addrs = [agent.register_buffer(t) for t in self.caches]

    def region(self, session: str) -> KVRegion:
        first = self.caches[0]
        return KVRegion(session, self.addrs, first.shape[1], first[0, 0].nbytes)


def check_port_range(port_range: tuple[int, int]) -> tuple[int, int]:
    """``(first, last)`` inclusive, as Mooncake accepts it; raises ``ValueError`` otherwise."""
    lo, hi = (int(p) for p in port_range)
    if not (_PORT_MIN <= lo < hi <= _PORT_MAX) or (lo <= _EPHEMERAL[1] and hi >= _EPHEMERAL[0]):
        raise ValueError(
            f"invalid value for 'port_range': {port_range!r}; need first < last (two ports per engine) "
            f"within [{_PORT_MIN}, {_PORT_MAX}] and outside the ephemeral range {list(_EPHEMERAL)}"
        )
    return lo, hi


def _set_mooncake_port_range(port_range: tuple[int, int] | None) -> None:
    """Export the range for Mooncake, which reads it once, when ``mooncake.engine`` is loaded."""
    if port_range is None:
        return
    want = tuple(str(p) for p in port_range)
    have = (os.environ.get("MC_MIN_RPC_PORT"), os.environ.get("MC_MAX_RPC_PORT"))
    if _MOONCAKE_MODULE in sys.modules:
        if have != want:
            raise RuntimeError(
                f"Mooncake is already loaded in this process with port range {have}; its port range "
                f"is read once per process, so {port_range} cannot apply (give every agent of a "
                "process the same range, or set MC_MIN_RPC_PORT / MC_MAX_RPC_PORT before start)"
            )
        return
    os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = want


def _proc_listeners() -> dict[int, tuple[str, int]] | None:
    """``{socket inode: (address, port)}`` of this process's listening TCP sockets (Linux ``/proc``)."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
        found: dict[int, tuple[str, int]] = {}
        for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            with open(f"/proc/self/net/{name}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] != "0A" or int(cols[9]) not in inodes:  # 0A: LISTEN
                        continue
                    addr_hex, port_hex = cols[1].split(":")
                    raw = b"".join(
                        bytes.fromhex(addr_hex[i : i + 8])[::-1] for i in range(0, len(addr_hex), 8)
                    )
                    found[int(cols[9])] = (socket.inet_ntop(family, raw), int(port_hex, 16))
        return found
    except (OSError, ValueError, StopIteration):
        return None


def _unmapped(addr: str) -> str:
    """``addr`` with a v4-mapped IPv6 address (``::ffff:a.b.c.d``) written as IPv4."""
    ip = ipaddress.ip_address(addr)
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _host_addrs(host: str) -> set[str]:
    try:
        return {_unmapped(host)}
    except ValueError:
        pass
    try:
        return {_unmapped(a[4][0]) for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


class KVTransferAgent:
    """One Mooncake transfer engine over this instance's KV tensors.

    ``host`` is the address peers reach this engine at (its session). ``port_range`` ``(first, last)``
    confines both of the engine's listening ports (``None``: Mooncake's ``MC_MIN_RPC_PORT`` /
    ``MC_MAX_RPC_PORT``, default 15000-17000); it is process-wide in Mooncake, so every agent of a
    process must ask for the same one. ``listen_addrs`` holds the engine's listening ``(address,
    port)`` pairs (``None`` where ``/proc`` cannot tell). Mooncake binds them to the wildcard address
    (``docs/security.md``): by default that is logged as a warning; with ``strict_bind`` an
    engine listening on anything but ``host`` is shut down and ``RuntimeError`` raised.
    ``peer_guard``: whether both listeners admit only this user's and root's local peers.
    """

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        host: str = "127.0.0.1",
        port_range: tuple[int, int] | None = None,
        strict_bind: bool = False,
    ) -> None:
        if port_range is not None:
            port_range = check_port_range(port_range)
        if not kv_caches or any(not t.is_contiguous() for t in kv_caches):
            raise ValueError("KV transfer needs contiguous per-layer KV tensors")
        _set_mooncake_port_range(port_range)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "PD disaggregation needs the Mooncake transfer engine: "
                "pip install mooncake-transfer-engine-non-cuda (and Debian libibverbs1); "
                "see ci/install_cluster_deps.sh"
            ) from e
        self._kv_caches = kv_caches  # keep the registered memory alive
        before = _proc_listeners()
        self._engine = TransferEngine()
        if self._engine.initialize(host, METADATA_MODE, PROTOCOL, "") != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to initialize on {host}")
        after = _proc_listeners()
        new = None if before is None or after is None else {k: v for k, v in after.items() if k not in before}
        self.listen_addrs: list[tuple[str, int]] | None = None if new is None else sorted(new.values())
        self._check_listeners(host, port_range, strict_bind)
        self.peer_guard = self._check_peer_guard(host, list(new or {}))
        addrs = [t.data_ptr() for t in kv_caches]
        if self._engine.batch_register_memory(addrs, [t.nbytes for t in kv_caches]) != 0:
            raise RuntimeError("Mooncake transfer engine failed to register the KV memory")
        first = kv_caches[0]
        self.region = KVRegion(
            session=f"{host}:{self._engine.get_rpc_port()}",
            layer_addrs=addrs,
            num_blocks=first.shape[1],
            block_bytes=first[0, 0].nbytes,
        )

    def _check_listeners(self, host: str, port_range: tuple[int, int] | None, strict_bind: bool) -> None:
        rpc_port = self._engine.get_rpc_port()
        ports = [rpc_port] + [p for _, p in self.listen_addrs or []]
        if port_range is not None and any(not port_range[0] <= p <= port_range[1] for p in ports):
            self._engine = None  # the engine closes its listeners when it is freed
            raise RuntimeError(
                f"Mooncake transfer engine listens on ports {sorted(set(ports))}, outside port_range "
                f"{port_range}: MC_MIN_RPC_PORT / MC_MAX_RPC_PORT were overridden before Mooncake loaded"
            )
        if self.listen_addrs is None:
            if strict_bind:
                self._engine = None
                raise RuntimeError("cannot verify where the Mooncake transfer engine listens (no /proc)")
            return
        allowed = _host_addrs(host)
        exposed = [(a, p) for a, p in self.listen_addrs if _unmapped(a) not in allowed]
        if not exposed:
            return
        msg = (
            f"Mooncake transfer engine for {host} listens on {exposed}, not only on {host}: it binds "
            "its handshake and TCP data sockets to the wildcard address, and any host that can reach "
            "these ports can read and write the registered KV memory; run the process with the "
            "memory.bind_host shim (engine processes of PD roles do) or restrict these ports at the "
            "network level (port_range gives the ports)"
        )
        if strict_bind:
            self._engine = None
            raise RuntimeError(msg)
        logger.warning(msg)

    def _check_peer_guard(self, host: str, inodes: list[int]) -> bool:
        """Whether the shim's accept guard covers every listener; warn where it does not, and where
        peers on other hosts may connect (the guard cannot tell who they are)."""
        ports = sorted({p for _, p in self.listen_addrs or []})
        guarded = bool(inodes) and all(bind_host.listener_guarded(i) for i in inodes)
        if guarded:
            problem = bind_host.owner_lookup_problem()
            if problem is not None:
                self._engine = None
                raise RuntimeError(
                    "the KV transfer listeners' accept guard cannot tell who owns a local connection, "
                    f"so it would refuse every local peer, this user's engines included: {problem}"
                )
        else:
            logger.warning(
                "Mooncake transfer engine for %s admits every local user on ports %s: it authenticates "
                "no peer, so any process on this host, of any uid, can read and write the registered KV "
                "memory; run the process with the memory.bind_host shim (engine processes of PD roles "
                "do), which closes connections from other users",
                host, ports,
            )  # fmt: skip
        addrs = _host_addrs(host)
        if not addrs or not all(ipaddress.ip_address(a).is_loopback for a in addrs):
            logger.warning(
                "Mooncake transfer engine listens on %s, which is not loopback: peers on other hosts "
                "(or in other network namespaces) cannot be checked by owner, and it authenticates no "
                "peer, so anyone who reaches ports %s there can read and write the registered KV "
                "memory; keep these ports on a trusted network or firewall them "
                "(cache.kv_transfer_port_range fixes them)",
                host, ports,
            )  # fmt: skip
        return guarded

    @property
    def num_peers_refused(self) -> int:
        """Connections to this process's guarded listeners closed because another local user made
        them (process-wide: every agent of the process shares the count)."""
        return bind_host.num_refused() or 0

    def read_blocks(self, peer: KVRegion, pairs: list[tuple[int, int]]) -> TransferStats:
        """Copy the peer's blocks into ours: ``pairs`` is ``[(peer block id, our block id)]``.

        One batched read for all layers; raises ``RuntimeError`` if the transfer fails.
        """
        t0 = time.perf_counter()
        if not pairs:
            return TransferStats(0, 0, 0, 0.0)
        src, dst, lengths = block_ranges(peer, self.region, pairs)
        rc = self._engine.batch_transfer_sync_read(peer.session, dst, src, lengths)
        if rc != 0:
            raise RuntimeError(f"KV transfer from {peer.session} failed (Mooncake code {rc})")
        return TransferStats(len(pairs), sum(lengths), len(lengths), time.perf_counter() - t0)

    def register_buffer(self, buffer: torch.Tensor) -> int:
        """Register one more contiguous tensor (EPD's embedding staging buffer) for peers to read and
        this engine to read into; returns its base address. Keep ``buffer`` alive while registered."""
        if not buffer.is_contiguous():
            raise ValueError("a transfer buffer must be contiguous")
        if self._engine.register_memory(buffer.data_ptr(), buffer.nbytes) != 0:
            raise RuntimeError("Mooncake transfer engine failed to register the buffer")
        return buffer.data_ptr()

    def read_ranges(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """One batched one-sided read of byte ranges ``src`` (the peer's) into ``dst`` (ours, registered);
        raises ``RuntimeError`` if the transfer fails."""
        if not lengths:
            return
        rc = self._engine.batch_transfer_sync_read(session, dst, src, lengths)
        if rc != 0:
            raise RuntimeError(f"transfer from {session} failed (Mooncake code {rc})")
