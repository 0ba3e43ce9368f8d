"""Small integers packed into int32 words, as GPTQ, AWQ and compressed-tensors store them.

A word holds ``32 // bits`` values along one dimension of the tensor; value ``j`` of a word sits at
bits ``[bits * j, bits * j + bits)``. AWQ's GEMM layout puts the columns of a word in an interleaved
order (``order[j]`` is the column held by slot ``j``); the other formats keep the natural order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: slot j of a word holds column 8 * word + AWQ_ORDER[j]


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None
) -> torch.Tensor:
    """The unsigned ``bits``-wide values of int32 ``packed``, unfolded along ``dim`` (its size times
    ``32 // bits``), as int32."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    per_word = 32 // bits
    dim = dim % packed.dim()
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    moved = packed.movedim(dim, -1).unsqueeze(-1)  # [..., words, 1]
    slots = (moved >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]: slot j of each word
    if order is not None:
        slots = slots[..., _inverse(order)]  # column c came from slot order.index(c)
    return slots.flatten(-2).movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Unsigned integers ``values`` (each below ``2**bits``) packed ``32 // bits`` to an int32 word
    along ``dim``, whose size must be a multiple of that; the inverse of ``unpack_int32``."""
    per_word = 32 // bits
    dim = dim % values.dim()
    v = values.to(torch.int64)
    if v.numel() and (v.min().item() < 0 or v.max().item() >= 1 << bits):
        raise ValueError(f"values to pack must lie in [0, {(1 << bits) - 1}]")
    if v.shape[dim] % per_word:
        raise ValueError(f"dimension {dim} ({v.shape[dim]}) is not a multiple of {per_word}")
    moved = v.movedim(dim, -1)
    slots = moved.reshape(*moved.shape[:-1], -1, per_word)  # [..., words, per_word]
    if order is not None:
        slots = slots[..., list(order)]  # slot j holds column order[j]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (slots << shifts).sum(dim=-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the same 32 bits, signed
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _inverse(order: Sequence[int]) -> list[int]:
    inverse = [0] * len(order)
    for slot, column in enumerate(order):
        inverse[column] = slot
    return inverse
