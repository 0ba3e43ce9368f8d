"""Token bitmasks: one bit per vocabulary id (1 = allowed), 32 ids per int32 word, little-endian.

The layout is the one xgrammar and llguidance fill (``[B, ceil(V / 32)]`` int32), so any backend can
write into the same buffer. Applying a mask adds 0 / -inf per id, looked up a byte at a time from a
256 x 8 table: branch-free, so its cost does not depend on how many ids a grammar allows
(``benchmarks/structured_backends.py`` measures it: ``docs/structured_outputs.md``).
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = 32
# _BYTE_BIAS[b, i]: 0.0 if bit i of byte b is set, else -inf
_BYTE_BIAS = np.where(
    (np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(0.0), np.float32(-np.inf)
).astype(np.float32)
_BYTE_BIAS_T = torch.from_numpy(_BYTE_BIAS)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row."""
    return (vocab_size + _BITS - 1) // _BITS


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 ``[num_rows, ceil(V / 32)]`` bitmask with every id allowed."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The ids a bitmask row allows (tests and debugging)."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little", count=vocab_size)
    return np.flatnonzero(bits).tolist()


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 ``[B, V]``: 0 where the bitmask allows the id, -inf elsewhere (on the bitmask's device)."""
    if bitmask.is_cpu:  # numpy's take is ~2x faster than torch indexing here
        as_bytes = bitmask.numpy().view(np.uint8)
        bias = np.take(_BYTE_BIAS, as_bytes, axis=0).reshape(as_bytes.shape[0], -1)
        return torch.from_numpy(bias[:, :vocab_size])
    table = _BYTE_BIAS_T.to(bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8).long()
    return table[as_bytes].view(as_bytes.shape[0], -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Mask (in place) the ids of row ``rows[i]`` of ``logits`` that row ``i`` of ``bitmask`` disallows.

    ``logits`` is float ``[N, V]``; ids past ``32 * bitmask.shape[1]`` are left as they are, so the
    bitmask must cover the whole logits width. Returns ``logits``.
    """
    if not rows:
        return logits
    bias = bitmask_bias(bitmask[: len(rows)], logits.shape[1]).to(logits.device, logits.dtype)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits.add_(bias)
    index = torch.tensor(rows, device=logits.device)
    logits.index_add_(0, index, bias)
    return logits
