"""KV transfer between engine instances over the Mooncake transfer engine.

``KVTransferAgent`` registers every layer's KV tensor with a Mooncake ``TransferEngine`` once and
then pulls whole blocks from a peer with batched one-sided reads into its own registered memory.
The peer is named by its session (``host:rpc_port``); the ``P2PHANDSHAKE`` metadata mode needs no
metadata server. On CPU the transport is TCP; RDMA / HCCS use the same calls.

The layout is ``PagedKVLayout``'s: layer ``l`` is one contiguous ``[2, num_blocks, block_size, heads,
head_dim]`` tensor, so block ``b`` of K (``kv = 0``) or V (``kv = 1``) starts at
``base_l + (kv * num_blocks + b) * block_bytes``. Runs of consecutive blocks on both sides are
coalesced into one range. ``mooncake`` is imported only when an agent is created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

PROTOCOL = "tcp"
METADATA_MODE = "P2PHANDSHAKE"


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


class KVTransferAgent:
    """One Mooncake transfer engine over this instance's KV tensors."""

    def __init__(self, kv_caches: list[torch.Tensor], host: str = "127.0.0.1") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "PD disaggregation needs the Mooncake transfer engine: "
                "pip install mooncake-transfer-engine-non-cuda (and Debian libibverbs1); "
                "see ci/install_cluster_deps.sh"
            ) from e
        if not kv_caches or any(not t.is_contiguous() for t in kv_caches):
            raise ValueError("KV transfer needs contiguous per-layer KV tensors")
        self._kv_caches = kv_caches  # keep the registered memory alive
        self._engine = TransferEngine()
        if self._engine.initialize(host, METADATA_MODE, PROTOCOL, "") != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to initialize on {host}")
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
