"""Logits processors that depend on token history: banned ids and repetition-style penalties.

Id lists are padded to one [B, L] tensor with the out-of-vocab id ``V`` and scattered into a
``[B, V + 1]`` buffer whose last column is dropped, so there are no Python loops over the vocab.
"""

from __future__ import annotations

import torch


def pad_token_ids(token_ids: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """int64 [B, max_len] (at least one column), rows right-padded with ``pad_id``."""
    width = max((len(ids) for ids in token_ids), default=0) or 1
    rows = [ids + [pad_id] * (width - len(ids)) for ids in token_ids]
    return torch.tensor(rows, dtype=torch.int64, device=device).view(len(token_ids), width)


def token_mask(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [B, V]: True where the row's id list contains the token."""
    ids = pad_token_ids(token_ids, vocab_size, device)
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab_size]


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [B, V]: how many times each token occurs in the row's id list."""
    ids = pad_token_ids(token_ids, vocab_size, device)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: list[list[int]]) -> torch.Tensor:
    """Set the banned ids of each row to -inf (returns a new tensor)."""
    mask = token_mask(banned_token_ids, logits.shape[1], logits.device)
    return logits.masked_fill(mask, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]] | None,
    repetition_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Apply the enabled penalties (None = off for every row); returns a new tensor.

    Repetition (HF / vLLM semantics): for tokens seen in prompt or output, positive logits are
    divided by the penalty and negative ones multiplied. Presence subtracts the penalty once per
    token present in the output; frequency subtracts ``count * penalty``.
    """
    vocab_size, device = logits.shape[1], logits.device
    if repetition_penalty is not None:
        seen_ids = [
            list(p) + list(o)
            for p, o in zip(prompt_token_ids or [[]] * len(output_token_ids), output_token_ids)
        ]
        seen = token_mask(seen_ids, vocab_size, device)
        penalty = repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if presence_penalty is None and frequency_penalty is None:
        return logits
    counts = token_counts(output_token_ids, vocab_size, device)
    if frequency_penalty is not None:
        logits = logits - frequency_penalty.unsqueeze(1) * counts
    if presence_penalty is not None:
        logits = logits - presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits
