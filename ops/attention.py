"""Attention facade: paged attention over a mixed prefill/decode batch.

Tokens of all sequences in a step are flattened into one ``[num_tokens, ...]`` batch, sequence
by sequence in batch order. Sequence ``b`` contributes ``query_lens[b]`` new tokens at positions
``seq_lens[b] - query_lens[b] .. seq_lens[b] - 1``; it attends causally to every earlier position
of its own context, whose K/V live in the paged KV cache at ``block_tables[b]``.

KV cache of one layer: tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
Slot ``s`` of the flat cache is block ``s // block_size``, offset ``s % block_size``. An 8-bit cache
(``cache.kv_cache_dtype`` int8 / fp8) has rows of ``head_dim + 4`` bytes: the values and their scale
(``ops/kv_quant.py``); every backend quantizes what it stores and dequantizes what it reads.

Attention sinks (gpt-oss, MiMo-V2-Flash's sliding-window layers): one learned logit per query head that
joins every softmax's denominator and attends to nothing, ``p_j = exp(s_j) / (sum_i exp(s_i) +
exp(sink))``. Only the reference backend (``ops/torch_ref``) computes them, so a call with sinks runs
there on every platform; full device graphs (``meta.static``) refuse them.
"""

from __future__ import annotations

import torch

from ops.attention_metadata import AttentionMetadata, ContiguousKV, build_attention_metadata
from ops.kv_quant import kv_format
from ops.registry import REFERENCE, get_op


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | ContiguousKV,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store ``k``/``v`` ([T, Hkv, D]) into ``kv_cache`` at ``meta.slot_mapping``, then return
    causal attention of ``q`` ([T, Hq, D], Hq a multiple of Hkv) over each sequence's context: [T, Hq, D].

    ``kv_cache`` is the paged tensor (reads go through ``meta.block_tables``) or, with the xTensor
    layout, a ``ContiguousKV`` (reads go straight to each sequence's slot, ``meta.kv_slots``).
    ``sinks`` ([Hq] float32, optional): each query head's sink logit (see above)."""
    if meta.static and sinks is not None:
        raise ValueError(
            "attention sinks do not run under full device graphs (their decode kernels have no sink "
            "term); use execution.graph_mode eager or partial"
        )
    if meta.static:  # a full device graph's decode step: everything read from device tensors
        op = get_op("attention_static")
        if (
            isinstance(kv_cache, torch.Tensor)
            and kv_format(kv_cache)
            and op is not get_op("attention_static", REFERENCE)
        ):
            raise ValueError(
                f"cache.kv_cache_dtype {kv_format(kv_cache)} does not run under full device graphs: this "
                "platform's graph decode kernel reads 16/32-bit caches; use execution.graph_mode eager or "
                "partial, or cache.kv_cache_dtype auto"
            )
        return op(q, k, v, kv_cache, meta, scale, sliding_window)
    name = "attention_contiguous" if isinstance(kv_cache, ContiguousKV) else "attention"
    if sinks is not None:  # the one backend with a sink term: never a kernel that would drop it
        return get_op(name, REFERENCE)(q, k, v, kv_cache, meta, scale, sliding_window, sinks)
    return get_op(name)(q, k, v, kv_cache, meta, scale, sliding_window)


__all__ = ["AttentionMetadata", "ContiguousKV", "attention", "build_attention_metadata"]
