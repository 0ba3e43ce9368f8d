"""What one step's attention needs to know about its batch (plain data, built once per step).

See ``ops/attention.py`` for the batch layout the fields describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ContiguousKV:
    """One layer's KV in the xTensor layout: the paged view every block-level op uses (``paged``:
    ``[2, num_blocks, block_size, Hkv, D]``, the same bytes) and, per chunk of sequence slots, each
    slot's K and V as one virtually contiguous range (``k_chunks[c]`` / ``v_chunks[c]``:
    ``[slots_per_chunk, max_len, Hkv, D]``). Sequence slot ``s`` is row ``s % slots_per_chunk`` of chunk
    ``s // slots_per_chunk``; positions past what the sequence holds read zeros or stale finite data
    and are masked out. The chunk lists grow as the layout adds chunks (same objects)."""

    paged: torch.Tensor
    k_chunks: list[torch.Tensor]
    v_chunks: list[torch.Tensor]
    slots_per_chunk: int


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative query lengths, on device
    seq_lens: torch.Tensor  # int32 [B], context length after this step, on device
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0, on device
    slot_mapping: torch.Tensor  # int64 [num_tokens], cache slot of each new token, on device
    query_lens_cpu: list[int]  # host copies (no device sync needed to loop)
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # xTensor: each sequence's slot (``ContiguousKV``); None with the paged layout
    kv_slots: list[int] | None = None
    # A full-step device graph's metadata (``graph/full.py``): one decode token per row, and only the
    # device tensors are current (the graph runner refreshes them before each replay); the host fields
    # describe the capture, not the step. Attention dispatches to ``attention_static``, which reads
    # nothing else. Rows with ``seq_lens`` 0 and ``slot_mapping`` -1 are padding: nothing is read or
    # written for them.
    static: bool = False
    # Per-step values a backend derives once and reuses in every layer (gather indices, masks, buffers);
    # keyed by backend. Lives as long as this metadata, i.e. one step.
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build ``AttentionMetadata`` from host lists: sequence ``b`` has ``query_lens[b]`` new tokens
    ending its context of ``seq_lens[b]`` tokens, stored in blocks ``block_tables[b]`` (which must
    cover ``seq_lens[b]`` tokens)."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    starts = [0]
    slots: list[int] = []
    for q_len, s_len, blocks in zip(query_lens, seq_lens, block_tables):
        if not 0 <= q_len <= s_len or len(blocks) * block_size < s_len:
            raise ValueError(f"bad sequence: query_len={q_len}, seq_len={s_len}, {len(blocks)} blocks")
        starts.append(starts[-1] + q_len)
        for pos in range(s_len - q_len, s_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max((len(b) for b in block_tables), default=0) or 1
    padded = [list(b) + [0] * (width - len(b)) for b in block_tables]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
    )
