"""Prompt lookup (n-gram) drafting: no model pass.

The last ``n`` tokens of the sequence (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
are looked up in the tokens before them; at the latest earlier occurrence, the tokens that followed it
are the draft. Longer suffixes are tried first (a longer match predicts better); the latest occurrence
is taken because recent context repeats most. The search is one vectorised comparison per ``n``.
"""

from __future__ import annotations

import numpy as np


def ngram_draft(token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``token_ids`` (none when no suffix of ``min_n``..``max_n``
    tokens occurred before, or ``k`` is 0)."""
    if k <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # windows starting at 0 .. length - n - 1: every earlier occurrence, the suffix itself excluded
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramIndex:
    """``ngram_draft`` for one growing sequence at a few dictionary lookups per step: every n-gram seen
    so far maps to the position after its latest occurrence, and each call indexes only the tokens
    added since the last (sequences only grow)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 1  # n-grams ending before position ``indexed`` are in ``follows``

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``token_ids`` (this sequence's tokens, grown since the
        last call); the same as ``ngram_draft(token_ids, k, min_n, max_n)``."""
        length = len(token_ids)
        for end in range(self.indexed, length):  # the suffix itself (ending at ``length``) excluded
            for n, follows in self.follows.items():
                if end >= n:
                    follows[tuple(token_ids[end - n : end])] = end
        self.indexed = max(self.indexed, length)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.follows[n].get(tuple(token_ids[length - n :]))
            if end is not None:
                return token_ids[end : end + k]
        return []
