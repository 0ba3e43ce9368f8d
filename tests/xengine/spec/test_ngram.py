"""Prompt lookup (``xengine/spec/ngram.py``): the draft follows the latest earlier occurrence of the
longest suffix of ``min_n``..``max_n`` tokens, capped at ``k`` tokens and at the sequence's end; checked
on hand-made sequences and against a brute-force reference on seeded random ones."""

from __future__ import annotations

import random

import numpy as np
import pytest

from xengine.spec.ngram import ngram_draft


def reference_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule spelled out with loops: longest suffix first, latest earlier start first."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_draft_is_what_followed_the_earlier_occurrence() -> None:
    # suffix [1, 2] occurred at 0, followed by 3 4 1 ...
    assert ngram_draft([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert ngram_draft([1, 2, 3, 4, 1, 2], 1, 1, 3) == [3]


def test_latest_occurrence_wins() -> None:
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    assert ngram_draft(tokens, 3, 1, 2) == [4, 1, 2]


def test_longer_suffix_is_tried_before_a_later_shorter_match() -> None:
    # "1 2" occurred at 0 (then 9); the single token "2" occurred later, at 5 (then 8)
    tokens = [1, 2, 9, 5, 7, 2, 8, 1, 2]
    assert ngram_draft(tokens, 1, 1, 2) == [9]
    assert ngram_draft(tokens, 1, 1, 1) == [8]


def test_min_n_bounds_the_shortest_suffix() -> None:
    tokens = [5, 2, 8, 1, 2]  # only the one-token suffix "2" occurred before
    assert ngram_draft(tokens, 2, 1, 3) == [8, 1]
    assert ngram_draft(tokens, 2, 2, 3) == []


def test_no_match_and_non_positive_k_give_nothing() -> None:
    assert ngram_draft([1, 2, 3, 4], 3, 1, 4) == []
    assert ngram_draft([1, 2, 1, 2], 0, 1, 4) == []
    assert ngram_draft([1, 2, 1, 2], -1, 1, 4) == []


def test_short_sequences() -> None:
    assert ngram_draft([], 3, 1, 4) == []
    assert ngram_draft([7], 3, 1, 4) == []
    assert ngram_draft([7, 7], 3, 1, 4) == [7]


def test_draft_stops_at_the_end_of_the_sequence() -> None:
    # "1" at 0 is followed by only 2 3 1 before the sequence ends: fewer than k tokens
    assert ngram_draft([1, 2, 3, 1], 5, 1, 4) == [2, 3, 1]
    # overlapping occurrence: the suffix "3 3" at 0 overlaps the suffix itself
    assert ngram_draft([3, 3, 3], 4, 1, 2) == [3]


def test_max_n_longer_than_the_sequence_is_capped() -> None:
    assert ngram_draft([4, 5, 4], 2, 1, 10) == [5, 4]


def test_numpy_input_gives_python_ints() -> None:
    draft = ngram_draft(np.array([10, 11, 12, 10], dtype=np.int32), 2, 1, 3)
    assert draft == [11, 12]
    assert all(type(t) is int for t in draft)


@pytest.mark.parametrize("vocab", [2, 3, 6])
def test_matches_the_brute_force_reference(vocab: int) -> None:
    rng = random.Random(vocab)
    for _ in range(400):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(0, 6)
        expected = reference_draft(tokens, k, min_n, max_n)
        assert ngram_draft(tokens, k, min_n, max_n) == expected, (tokens, k, min_n, max_n)
