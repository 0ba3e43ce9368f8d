"""Head-range reads between instances that split the KV heads differently: moving bytes along the
ranges ``head_ranges`` gives each destination rank exactly its heads of each block."""

from __future__ import annotations

import pytest
import torch

from memory.head_ranges import RankKV, head_ranges
from memory.transfer import KVRegion

LAYERS, BLOCK, HEADS, DIM = 2, 4, 4, 3


def _pool(num_blocks: int, heads: int, fill: torch.Tensor | None = None) -> list[torch.Tensor]:
    return [
        (fill[layer] if fill is not None else torch.zeros(2, num_blocks, BLOCK, heads, DIM)).contiguous()
        for layer in range(LAYERS)
    ]


def _rank(pool: list[torch.Tensor], first: int, session: str) -> RankKV:
    region = KVRegion(session, [t.data_ptr() for t in pool], pool[0].shape[1], pool[0][0, 0].nbytes)
    return RankKV(region, first, pool[0].shape[3])


def _split(full: torch.Tensor, tp: int, num_blocks: int) -> list[tuple[list[torch.Tensor], int]]:
    """The model's KV ``full`` [layers, 2, blocks, block, HEADS, DIM] as ``tp`` ranks hold it."""
    out = []
    for r in range(tp):
        first, count = (r * HEADS // tp, HEADS // tp) if tp <= HEADS else (r * HEADS // tp, 1)
        out.append((_pool(num_blocks, count, full[:, :, :, :, first : first + count]), first))
    return out


def _copy(ranges, memory: dict[int, torch.Tensor]) -> None:
    """Apply byte ranges between tensors of this process (stands in for the Mooncake read)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, t) for t in memory.values())

    def view(addr: int, n: int) -> torch.Tensor:
        base, end, t = next(s for s in spans if s[0] <= addr < s[1])
        return t.view(-1).view(torch.uint8)[addr - base : addr - base + n]

    for _, src, dst, lengths in ranges:
        for a, b, n in zip(src, dst, lengths):
            view(b, n).copy_(view(a, n))


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (8, 1), (1, 1), (2, 2)])
def test_every_destination_rank_gets_exactly_its_heads(src_tp: int, dst_tp: int) -> None:
    full = torch.randn(LAYERS, 2, 6, BLOCK, HEADS, DIM)
    sources = _split(full, src_tp, 6)
    pairs = [(1, 0), (2, 1), (5, 3)]
    src_ranks = [_rank(pool, first, f"s{r}") for r, (pool, first) in enumerate(sources)]
    for pool, first in _split(torch.zeros(LAYERS, 2, 5, BLOCK, HEADS, DIM), dst_tp, 5):
        dst = _rank(pool, first, "d")
        ranges = head_ranges(src_ranks, dst, pairs, BLOCK)
        memory = {id(t): t for p, _ in sources for t in p} | {id(t): t for t in pool}
        _copy(ranges, memory)
        count = pool[0].shape[3]
        for layer in range(LAYERS):
            for sb, db in pairs:
                assert torch.equal(pool[layer][:, db], full[layer][:, sb, :, first : first + count])
        if src_tp == dst_tp:  # the same split: whole runs of blocks, no per-token ranges
            assert sum(len(r[1]) for r in ranges) <= LAYERS * 2 * len(pairs)


def test_a_layout_that_differs_is_refused() -> None:
    a = _pool(3, 2)
    b = [torch.zeros(2, 3, BLOCK, 2, DIM + 1) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="KV layouts differ"):
        head_ranges([_rank(a, 0, "s")], _rank(b, 0, "d"), [(0, 0)], BLOCK)
