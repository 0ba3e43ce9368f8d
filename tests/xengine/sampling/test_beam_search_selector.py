"""Host-side beam selection (xLLM §4.5.1 min-heap with early termination) vs a full sort."""

from __future__ import annotations

import random

import pytest

from xengine.sampling.beam_search import NEG_INF, BeamHypotheses, BeamSelector, select_brute_force


def _random_candidates(rng: random.Random, num_beams: int, num_cands: int, num_masked: int = 0):
    scores = [rng.uniform(-20, 0) for _ in range(num_beams)]
    lps, ids = [], []
    for _ in range(num_beams):
        row = sorted((rng.uniform(-15, 0) for _ in range(num_cands)), reverse=True)
        cut = rng.randrange(0, num_masked + 1)
        row = row[: num_cands - cut] + [NEG_INF] * cut
        lps.append(row)
        ids.append(rng.sample(range(50_000), num_cands))
    return scores, lps, ids


@pytest.mark.parametrize(
    "num_beams,num_cands,k", [(1, 8, 4), (4, 8, 8), (16, 32, 16), (64, 128, 64), (8, 3, 20)]
)
def test_selector_matches_full_sort(num_beams: int, num_cands: int, k: int) -> None:
    rng = random.Random(num_beams * 1000 + k)
    selector = BeamSelector(k)
    for _ in range(20):  # the same selector (and its buffers) across steps
        scores, lps, ids = _random_candidates(rng, num_beams, num_cands, num_masked=num_cands // 2)
        num = selector.select(scores, lps, ids)
        want = select_brute_force(scores, lps, ids, k)
        got = list(zip(selector.scores, selector.beam_indices, selector.token_ids))
        assert num == len(want)
        assert got == want


def test_selector_breaks_early_on_sorted_rows() -> None:
    # beam 0 dominates: every other beam's first candidate already loses to the heap top
    scores = [0.0] + [-100.0] * 63
    lps = [[-0.1 * j for j in range(64)] for _ in range(64)]
    ids = [list(range(64)) for _ in range(64)]
    selector = BeamSelector(8)
    selector.select(scores, lps, ids)
    assert selector.beam_indices == [0] * 8 and selector.token_ids == list(range(8))
    assert selector.num_visited <= 9 + 63  # 8 kept + 1 rejected in beam 0, one look per other beam


def test_selector_ties_keep_lower_beam_and_rank() -> None:
    selector = BeamSelector(3)
    selector.select([0.0, 0.0], [[-1.0, -1.0], [-1.0, -2.0]], [[10, 11], [20, 21]])
    assert selector.token_ids == [10, 11, 20]


def test_hypotheses_keep_best_and_length_penalty() -> None:
    hyps = BeamHypotheses(num_beams=2, length_penalty=1.0)
    hyps.add(-4.0, [1, 2], True)  # -2.0
    hyps.add(-3.0, [1, 2, 3], False)  # -1.0
    hyps.add(-9.0, [1, 2, 3], True)  # -3.0: worse than both, dropped
    assert [h.score for h in hyps.hyps] == [-1.0, -2.0]
    assert hyps.cannot_improve(best_running=-7.0, num_generated=3, max_new=10, early_stopping=False)
    assert not hyps.cannot_improve(best_running=-5.0, num_generated=3, max_new=10, early_stopping=False)
