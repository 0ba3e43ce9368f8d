"""Byte ranges that move KV blocks between instances whose ranks hold different KV heads.

A paged KV block of one layer is ``[block_size, heads, head_dim]`` for K, then the same for V (the pool
is ``[2, num_blocks, block_size, heads, head_dim]``). A tensor-parallel rank holds heads
``[first, first + count)`` of the model's. To fill a destination rank's blocks from source ranks that
split the heads differently, each token of each block of each layer needs, per source rank, the run of
heads both hold: one range of ``overlap x head_dim`` elements. A head held by several source ranks
(replicated when TP exceeds the KV head count) is read from the first of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory.transfer import KVRegion


@dataclass(frozen=True)
class RankKV:
    """One rank's registered KV memory and the heads it holds."""

    region: KVRegion
    first_head: int
    num_heads: int


def head_ranges(
    sources: list[RankKV],
    dst: RankKV,
    pairs: list[tuple[int, int]],
    block_size: int,
) -> list[tuple[str, list[int], list[int], list[int]]]:
    """Per source session: ``(session, src addrs, dst addrs, lengths)`` copying the destination's heads
        of every ``(source block, destination block)`` pair, for every layer's K and V. Ranges contiguous on
    both sides merge (the same split on both: one range per run of blocks)."""
    head_bytes = dst.region.block_bytes // (block_size * dst.num_heads)
    for s in sources:
        if s.region.block_bytes != head_bytes * block_size * s.num_heads or len(s.region.layer_addrs) != len(
            dst.region.layer_addrs
        ):
            raise ValueError(
                "KV layouts differ between the two instances (bytes per head and token, or layers); run "
                "both with the same model, dtype, cache.kv_cache_dtype auto and cache.block_size"
            )
    out = []
    covered = dst.first_head
    last = dst.first_head + dst.num_heads
    for s in sources:
        lo, hi = max(covered, s.first_head), min(last, s.first_head + s.num_heads)
        if lo >= hi:
            continue
        covered = hi
        src_addrs: list[int] = []
        dst_addrs: list[int] = []
        lengths: list[int] = []
        src_off, dst_off, length = (
            (lo - s.first_head) * head_bytes,
            (lo - dst.first_head) * head_bytes,
            (hi - lo) * head_bytes,
        )
        sbb, dbb = s.region.block_bytes, dst.region.block_bytes
        s_token, d_token = s.num_heads * head_bytes, dst.num_heads * head_bytes
        for s_base, d_base in zip(s.region.layer_addrs, dst.region.layer_addrs):
            for kv in (0, 1):
                for sb, db in pairs:
                    s_block = s_base + (kv * s.region.num_blocks + sb) * sbb
                    d_block = d_base + (kv * dst.region.num_blocks + db) * dbb
                    for t in range(block_size):
                        a, b = s_block + t * s_token + src_off, d_block + t * d_token + dst_off
                        if lengths and src_addrs[-1] + lengths[-1] == a and dst_addrs[-1] + lengths[-1] == b:
                            lengths[-1] += length  # contiguous on both sides (same split): one range
                        else:
                            src_addrs.append(a)
                            dst_addrs.append(b)
                            lengths.append(length)
        out.append((s.region.session, src_addrs, dst_addrs, lengths))
    if covered < last:
        raise ValueError(f"the source ranks do not hold KV heads {covered}..{last - 1} the destination needs")
    return out
