"""``NgramIndex`` (the per-sequence prompt-lookup index the proposer keeps) drafts exactly what
``ngram_draft`` does on the same tokens, call after call as the sequence grows; the proposer drops a
sequence's index when the scheduler ends it."""

from __future__ import annotations

import random

from xengine.api.messages import SamplingParams
from xengine.request import Request
from xengine.spec.drafting import NgramProposer
from xengine.spec.ngram import NgramIndex, ngram_draft


def test_the_index_drafts_what_the_full_search_drafts() -> None:
    rng = random.Random(0)
    for _ in range(300):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        for _ in range(30):
            k = rng.randint(0, 5)
            assert index.draft(tokens, k) == ngram_draft(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 4))]


def test_the_proposer_keeps_an_index_per_sequence_until_released() -> None:
    proposer = NgramProposer(1, 3)
    req = Request("a", "a", 0, [7, 8, 9, 7, 8], SamplingParams(max_tokens=10))
    assert proposer.propose(req, 3) == [9, 7, 8]
    req.output_token_ids += [9, 7]
    assert proposer.propose(req, 2) == [8, 9]  # the longest suffix (9, 7) is found first
    assert set(proposer.indexes) == {"a"}
    proposer.release("a")
    assert proposer.indexes == {}
