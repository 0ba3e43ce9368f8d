"""Block records: one KV block of every layer as one contiguous run of bytes.

A record is ``[num_layers, 2 (K, V), block_bytes]``: what a tier stores under the block's chained
hash. ``BlockRecords`` gathers records out of the engine's paged KV tensors and scatters them back;
8-bit caches move their scales with their rows, as PD transfer does (``memory/transfer.py``).
"""

from __future__ import annotations

import torch


class BlockRecords:
    """Gather / scatter whole blocks of ``kv_caches`` (per layer ``[2, num_blocks, block_size, H, D]``)."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("KV tiers need at least one layer's KV tensor")
        first = kv_caches[0]
        self.num_blocks = first.shape[1]
        self.block_bytes = first[0, 0].nbytes
        # byte views [2, num_blocks, block_bytes]: a block of any element type moves as bytes
        self._layers = [t.view(torch.uint8).view(2, self.num_blocks, self.block_bytes) for t in kv_caches]
        self.num_layers = len(kv_caches)
        self.record_bytes = self.num_layers * 2 * self.block_bytes

    def empty(self, n: int) -> torch.Tensor:
        """A host buffer for ``n`` records."""
        return torch.empty((n, self.record_bytes), dtype=torch.uint8)

    def gather(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``[len(block_ids), record_bytes]``: the blocks' records (into ``out`` when given)."""
        out = self.empty(len(block_ids)) if out is None else out
        view = out.view(len(block_ids), self.num_layers, 2, self.block_bytes)
        idx = torch.tensor(block_ids, dtype=torch.long)
        for layer, kv in enumerate(self._layers):
            view[:, layer].copy_(kv.index_select(1, idx.to(kv.device)).transpose(0, 1))
        return out

    def scatter(self, block_ids: list[int], records: torch.Tensor) -> None:
        """Write ``records`` (``[len(block_ids), record_bytes]``) into the blocks ``block_ids``."""
        view = records.view(len(block_ids), self.num_layers, 2, self.block_bytes)
        idx = torch.tensor(block_ids, dtype=torch.long)
        for layer, kv in enumerate(self._layers):
            kv.index_copy_(1, idx.to(kv.device), view[:, layer].transpose(0, 1).to(kv.device))
