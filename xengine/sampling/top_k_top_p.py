"""Probability truncation for random rows: top-k, top-p (nucleus) and min-p.

Each function masks dropped tokens to -inf (or 0 for probabilities) and never drops a row's
most likely token. A full-vocab sort happens only when top-p is enabled; top-k alone uses
``torch.topk``. Ties at the k-th value keep every tied token.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (0 = keep all). ``max_top_k`` avoids a device sync."""
    vocab_size = logits.shape[1]
    if max_top_k is None:
        max_top_k = int(top_k.max().item()) if top_k.numel() else 0
    max_top_k = min(max_top_k, vocab_size)
    if max_top_k <= 0:
        return logits
    values = torch.topk(logits, max_top_k, dim=1).values  # sorted descending
    k = top_k.clamp(min=0, max=max_top_k)
    kth = values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    kth = kth.masked_fill((k == 0).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k (optional) then top-p on one ascending sort of each row.

    Top-p keeps the smallest set of most likely tokens whose probability sums to at least
    ``top_p`` (after top-k renormalisation); 1.0 = keep all.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=False)
    if top_k is not None:
        k = top_k.clamp(min=0, max=vocab_size)
        pos = torch.where(k == 0, torch.zeros_like(k), vocab_size - k)
        kth = sorted_logits.gather(1, pos.unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    cum_probs = sorted_logits.softmax(dim=1).cumsum(dim=1)
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero probabilities below ``min_p * max_prob`` of their row (result is not renormalised)."""
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)
