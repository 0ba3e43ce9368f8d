"""Draft verification (``xengine/spec/verify.py``).

The central property is sampling exactness: whatever the drafts, the tokens a random row emits are
distributed exactly as the target's own tokens (token 1 ~ row 0's distribution; after an accepted draft,
token 2 ~ row 1's; after all drafts, the bonus ~ the last row's). Thousands of seeded ``verify`` calls
are compared with the exact distribution by a chi-square test at p = 0.001, and a deliberately biased
acceptance rule must fail the same test. Also: greedy rows accept exactly while the draft is the argmax;
a group without drafts draws exactly as the plain sampler; top-k / top-p / min-p rows never emit a token
outside their kept set, even through the residual; seeded draws are reproducible.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from xengine.api.sampling_params import SamplingParams
from xengine.sampling.metadata import SamplingMetadata
from xengine.sampling.sampler import Sampler, process_logits, sampling_probs
from xengine.spec.verify import DraftGroup, verify

CPU = torch.device("cpu")
# chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df));
# hard-coded: scipy is no dependency of this project
CHI2_CRITICAL_P001 = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
    10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697, 16: 39.252, 17: 40.79,
}  # fmt: skip
NUM_TRIALS = 20000

# target distributions of rows 0, 1, 2 (before temperature) over a 6-token vocabulary; the drafts
# (1 at row 0, 3 at row 1) are accepted with probability ~0.4 and ~0.5: both paths are common
TARGET_PROBS = [
    [0.10, 0.40, 0.20, 0.15, 0.10, 0.05],
    [0.20, 0.10, 0.10, 0.50, 0.05, 0.05],
    [0.30, 0.20, 0.20, 0.10, 0.10, 0.10],
]
DRAFTS = [1, 3]

Outcome = tuple[int, ...]


def make_meta(params: list[SamplingParams], generators: dict[int, torch.Generator]) -> SamplingMetadata:
    """The step's metadata as the runner builds it: one ``SamplingParams`` per logits row."""
    n = len(params)
    return SamplingMetadata.from_params(
        params, [[] for _ in range(n)], [[0] for _ in range(n)], generators, [], CPU
    )


def target_logits() -> torch.Tensor:
    return torch.tensor(TARGET_PROBS, dtype=torch.float32).log()


def exact_row_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Each row's target distribution under ``params`` (temperature, top-k, min-p), computed
    independently of the sampler (float64, normalised)."""
    scaled = logits.double() / params.temperature
    if params.top_k > 0:
        kth = scaled.topk(params.top_k, dim=1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=1, keepdim=True)


def exact_outcomes(row_probs: torch.Tensor, drafts: list[int]) -> dict[Outcome, float]:
    """Probability of every emitted token sequence when each token follows its row's target
    distribution: a token equal to the draft continues, any other token (or the bonus) ends it."""
    out: dict[Outcome, float] = {}
    prefix: Outcome = ()
    mass = 1.0
    for j in range(len(drafts) + 1):
        for token, p in enumerate(row_probs[j].tolist()):
            if j < len(drafts) and token == drafts[j]:
                continue
            out[(*prefix, token)] = mass * p
        if j < len(drafts):
            mass *= float(row_probs[j, drafts[j]])
            prefix = (*prefix, drafts[j])
    return out


def chi_square(counts: Counter, probs: dict[Outcome, float], num: int) -> tuple[float, int]:
    """Pearson's statistic over the outcomes of nonzero probability, and its degrees of freedom; an
    outcome of probability zero that occurred makes the statistic infinite."""
    if any(probs.get(o, 0.0) == 0.0 for o in counts):
        return float("inf"), 1
    cells = [o for o, p in probs.items() if p > 0.0]
    assert all(num * probs[o] >= 5 for o in cells)  # the chi-square approximation holds
    stat = sum((counts[o] - num * probs[o]) ** 2 / (num * probs[o]) for o in cells)
    return stat, len(cells) - 1


def run_trials(
    params: SamplingParams, drafts: list[int], num: int, seed: int, accept_rule: Callable | None = None
) -> tuple[Counter, Counter]:
    """Counts of the first emitted token and of the whole emitted sequence over ``num`` calls of one
    group (rows 0 .. len(drafts)) sharing one seeded generator, as the runner shares a request's."""
    gen = torch.Generator().manual_seed(seed)
    meta = make_meta([params] * (len(drafts) + 1), {row: gen for row in range(len(drafts) + 1)})
    logits = process_logits(target_logits(), meta)
    groups = [DraftGroup(0, drafts)]
    first: Counter = Counter()
    whole: Counter = Counter()
    for _ in range(num):
        (emitted,) = verify(logits, meta, groups, accept_rule=accept_rule)
        assert [row for row, _ in emitted] == list(range(len(emitted)))  # token i comes from row i
        tokens = tuple(t for _, t in emitted)
        assert list(tokens[:-1]) == drafts[: len(tokens) - 1]  # accepted drafts, then one more token
        first[tokens[0]] += 1
        whole[tokens] += 1
    return first, whole


EXACTNESS_CASES = {
    "temperature": SamplingParams(temperature=0.8, seed=0),
    "top_k": SamplingParams(temperature=1.3, top_k=5, seed=0),
    # min-p leaves the sampler's distribution unnormalised: acceptance must divide by its sum
    "min_p": SamplingParams(temperature=1.0, min_p=0.3, seed=0),
}


@pytest.mark.parametrize("case", EXACTNESS_CASES)
def test_emitted_tokens_follow_the_target_distribution(case: str) -> None:
    params = EXACTNESS_CASES[case]
    row_probs = exact_row_probs(target_logits(), params)
    first, whole = run_trials(params, DRAFTS, NUM_TRIALS, seed=1234)

    first_probs = {(t,): p for t, p in enumerate(row_probs[0].tolist())}
    stat, df = chi_square(Counter({(t,): c for t, c in first.items()}), first_probs, NUM_TRIALS)
    assert stat < CHI2_CRITICAL_P001[df], (stat, df, first)

    # the joint law of the first, second and bonus tokens (where they exist)
    stat, df = chi_square(whole, exact_outcomes(row_probs, DRAFTS), NUM_TRIALS)
    assert stat < CHI2_CRITICAL_P001[df], (stat, df, whole)
    assert whole[tuple(DRAFTS) + (0,)] > 0  # the bonus path ran


def test_a_biased_acceptance_rule_fails_the_same_test() -> None:
    params = EXACTNESS_CASES["temperature"]
    row_probs = exact_row_probs(target_logits(), params)
    first, whole = run_trials(params, DRAFTS, NUM_TRIALS, seed=1234, accept_rule=lambda p: min(1.0, 1.5 * p))

    first_probs = {(t,): p for t, p in enumerate(row_probs[0].tolist())}
    stat, df = chi_square(Counter({(t,): c for t, c in first.items()}), first_probs, NUM_TRIALS)
    assert stat > CHI2_CRITICAL_P001[df], (stat, df)
    stat, df = chi_square(whole, exact_outcomes(row_probs, DRAFTS), NUM_TRIALS)
    assert stat > CHI2_CRITICAL_P001[df], (stat, df)


def greedy_logits() -> torch.Tensor:
    """Six rows whose argmaxes are 2, 0, 5, 3, 1, 4 (row 1 also ties at tokens 0 and 4)."""
    logits = torch.zeros(6, 6)
    for row, top in enumerate([2, 0, 5, 3, 1, 4]):
        logits[row, top] = 3.0
        logits[row, (top + 1) % 6] = 1.0
    logits[1, 4] = 3.0  # tie with token 0: the first index is the argmax, as the plain sampler does
    return logits


@pytest.mark.parametrize(
    ("drafts", "expected"),
    [
        ([2, 0], [(0, 2), (1, 0), (2, 5)]),  # all accepted: the bonus argmax too
        ([2, 1], [(0, 2), (1, 0)]),  # first mismatch at row 1: its argmax, then stop
        ([2, 4], [(0, 2), (1, 0)]),  # the tied token that is not the argmax is a mismatch
        ([4, 0], [(0, 2)]),  # first mismatch at row 0
        ([], [(0, 2)]),  # no drafts: one plain greedy token
    ],
)
def test_greedy_rows_accept_while_the_draft_is_the_argmax(drafts: list[int], expected: list) -> None:
    logits = greedy_logits()
    meta = make_meta([SamplingParams(temperature=0.0)] * 6, {})
    assert meta.all_greedy
    assert verify(logits, meta, [DraftGroup(0, drafts)]) == [expected]


def test_greedy_and_random_groups_in_one_batch() -> None:
    """Several groups: each reads its own rows; greedy rows stay exact beside random ones."""
    logits = greedy_logits()
    gen = torch.Generator().manual_seed(5)
    greedy, random = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)
    meta = make_meta([greedy, greedy, greedy, random, random, greedy], {3: gen, 4: gen})
    assert not meta.all_greedy and not meta.all_random
    groups = [DraftGroup(0, [2, 0]), DraftGroup(3, [3]), DraftGroup(5, [])]
    num_accepted = 0
    for _ in range(50):
        out = verify(logits, meta, groups)
        assert out[0] == [(0, 2), (1, 0), (2, 5)]
        assert out[2] == [(5, 4)]
        rows, tokens = [row for row, _ in out[1]], [token for _, token in out[1]]
        assert (rows, tokens[0] == 3) in (([3, 4], True), ([3], False))  # accepted + bonus, or rejected
        num_accepted += len(rows) == 2
    assert 0 < num_accepted < 50


def test_a_group_without_drafts_draws_as_the_plain_sampler() -> None:
    """Seeded rows (any truncation) and greedy rows give the sampler's token; the unseeded row is only
    checked to be a token it could draw."""
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)) * 2
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=3, seed=2),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),  # unseeded: the global RNG
    ]
    seeded = [0, 1, 2]
    groups = [DraftGroup(row, []) for row in range(5)]
    for seed in range(200):
        gens_a = {row: torch.Generator().manual_seed(seed * 10 + row) for row in seeded}
        gens_b = {row: torch.Generator().manual_seed(seed * 10 + row) for row in seeded}
        meta_a, meta_b = make_meta(params, gens_a), make_meta(params, gens_b)
        plain = Sampler()(logits, meta_a).sampled_token_ids.tolist()
        out = verify(process_logits(logits, meta_b), meta_b, groups)
        assert [pairs[0][0] for pairs in out] == list(range(5)) and all(len(p) == 1 for p in out)
        tokens = [pairs[0][1] for pairs in out]
        assert tokens[:4] == plain[:4], seed
        assert float(sampling_probs(logits, meta_b)[4, tokens[4]]) > 0.0


def restricted_case() -> tuple[torch.Tensor, list[SamplingParams], list[set[int]]]:
    """Three rows and the tokens each one keeps: top-k 2, top-p 0.6, min-p 0.5."""
    probs = torch.tensor(
        [
            [0.05, 0.30, 0.10, 0.35, 0.15, 0.05],  # top_k=2 keeps {3, 1}
            [0.35, 0.04, 0.30, 0.15, 0.10, 0.06],  # top_p=0.6 keeps {0, 2} (0.35 + 0.30 >= 0.6)
            [0.10, 0.05, 0.40, 0.25, 0.15, 0.05],  # min_p=0.5 keeps p >= 0.2: {2, 3}
        ]
    )
    params = [
        SamplingParams(temperature=1.0, top_k=2, seed=0),
        SamplingParams(temperature=1.0, top_p=0.6, seed=0),
        SamplingParams(temperature=1.0, min_p=0.5, seed=0),
    ]
    return probs.log(), params, [{1, 3}, {0, 2}, {2, 3}]


@pytest.mark.parametrize("row", [0, 1, 2])
def test_truncated_rows_never_emit_a_dropped_token(row: int) -> None:
    """Row ``row``'s settings on all three positions: drafts outside the kept set are always rejected,
    the residual never reaches outside it, and inside drafts are both accepted and rejected."""
    logits, params, kept = restricted_case()
    logits = logits[row].expand(3, -1).contiguous()
    allowed = kept[row]
    gen = torch.Generator().manual_seed(row)
    meta = make_meta([params[row]] * 3, {0: gen, 1: gen, 2: gen})
    assert set(torch.nonzero(sampling_probs(logits, meta)[0]).flatten().tolist()) == allowed
    inside, outside = min(allowed), min(set(range(6)) - allowed)
    groups = [DraftGroup(0, [inside, outside])]
    num_first_accepted = 0
    for _ in range(2000):
        (emitted,) = verify(logits, meta, groups)
        assert all(token in allowed for _, token in emitted), emitted
        num_first_accepted += len(emitted) == 2
        assert len(emitted) <= 2  # the outside draft at row 1 is never accepted
    assert 0 < num_first_accepted < 2000


def test_a_draft_holding_all_the_mass_is_accepted() -> None:
    logits, _, _ = restricted_case()
    logits = logits[0].expand(2, -1).contiguous()
    gen = torch.Generator().manual_seed(0)
    meta = make_meta([SamplingParams(temperature=1.0, top_k=1, seed=0)] * 2, {0: gen, 1: gen})
    for _ in range(200):
        assert verify(logits, meta, [DraftGroup(0, [3])]) == [[(0, 3), (1, 3)]]
        assert verify(logits, meta, [DraftGroup(0, [1])]) == [[(0, 3)]]


def seeded_run(seed: int, num: int) -> list[list[list[tuple[int, int]]]]:
    """``num`` verify calls over two seeded groups (rows 0-2 and 3-4)."""
    gens = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)]
    params = SamplingParams(temperature=1.0, seed=seed)
    meta = make_meta([params] * 5, {0: gens[0], 1: gens[0], 2: gens[0], 3: gens[1], 4: gens[1]})
    logits = torch.cat([target_logits(), target_logits()[:2]])
    groups = [DraftGroup(0, DRAFTS), DraftGroup(3, [2])]
    return [verify(logits, meta, groups) for _ in range(num)]


def test_seeded_generators_make_verification_reproducible() -> None:
    first = seeded_run(7, 300)
    assert seeded_run(7, 300) == first
    assert seeded_run(8, 300) != first


def test_unseeded_rows_follow_the_global_rng() -> None:
    meta = make_meta([SamplingParams(temperature=1.0)] * 3, {})
    assert not meta.generators

    def run() -> list:
        with torch.random.fork_rng():
            torch.manual_seed(99)
            return [verify(target_logits(), meta, [DraftGroup(0, DRAFTS)]) for _ in range(300)]

    assert run() == run()
