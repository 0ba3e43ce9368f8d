"""Which keys a query may attend to: the causal (and sliding-window) rule, defined once.

A query at position ``p`` sees the keys at positions ``p - window < k <= p`` (every ``k <= p`` without a
window). The reference attention paths (paged, xTensor, static decode: ``ops/torch_ref/``) build their
masks from these helpers, so every backend's oracle applies the same rule; kernels that mask by their
own loop bounds (``ops/cpu_kernels/decode_attention.c``, ``ops/triton_kernels/decode_attention.py``)
are tested against them. See ``docs/cpu_kernels.md`` for the attention paths.
"""

from __future__ import annotations

import torch


def visible_keys(key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask (broadcast of ``key_pos`` against ``query_pos``): key visible to the query."""
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return allowed


def additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    """Float32 mask for SDPA's ``attn_mask``: 0 where ``allowed``, -inf elsewhere."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def decode_mask(
    cache: dict[int | None, torch.Tensor],
    last: torch.Tensor,
    max_len: int,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Additive ``[B, 1, 1, max_len]`` mask of decodes whose query sits at ``last`` ([B, 1]).

    It depends only on the step, so it is built once per window into ``cache`` and reused by every layer.
    """
    mask = cache.get(sliding_window)
    if mask is None:
        allowed = visible_keys(torch.arange(max_len, device=device), last, sliding_window)
        mask = cache[sliding_window] = additive_mask(allowed)[:, None, None, :]
    return mask


def is_fresh_prefill(first: int, q_len: int, sliding_window: int | None) -> bool:
    """A chunk from position ``first`` with no cached context and no window shorter than itself: its own
    K/V are its whole context, under a plain causal mask."""
    return first == 0 and (sliding_window is None or sliding_window >= q_len)


def context_start(first: int, sliding_window: int | None) -> int:
    """First key position any query from ``first`` on can see (keys before it are outside every window)."""
    return 0 if sliding_window is None else max(0, first - sliding_window + 1)


def prefill_mask(
    first: int, seq_len: int, start: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean ``[seq_len - first, seq_len - start]`` mask of the queries at ``first .. seq_len - 1``
    over the keys at ``start .. seq_len - 1``."""
    key_pos = torch.arange(start, seq_len, device=device)
    query_pos = torch.arange(first, seq_len, device=device).unsqueeze(1)
    return visible_keys(key_pos, query_pos, sliding_window)
