"""Sampling under speculation is exact through the whole engine: for one prompt, the distribution of
the next three tokens with speculation on (n-gram, and a draft model) equals the distribution with it off.

``allowed_token_ids`` narrows the tiny model's vocabulary to 6 ids and the prompt repeats them, so
prompt lookup drafts on most steps and the target (temperature 1) accepts some drafts and rejects
others: both branches of the rejection sampler run. 5,000 seeded samples per side; two-sample
chi-square at p = 0.001 on each position's token and on the first two tokens together."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from xengine.api.messages import SamplingParams
from xengine.llm import LLM
from xengine.runner import model_runner
from xengine.spec.verify import verify

ALLOWED = [11, 23, 37, 41, 59, 63]
PROMPT = [11, 23, 37, 41, 11, 23, 37, 59, 11, 23]
SAMPLES = 5000
Z_999 = 3.0902  # the standard normal's 0.999 quantile


def _critical(dof: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 1% from 5 degrees of
    freedom on)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + Z_999 * c**0.5) ** 3


def _two_sample_chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square of two samples of equal size over their cells (cells seen fewer than 10 times in
    both together are pooled into one), and its degrees of freedom."""
    cells = set(a) | set(b)
    rare = [c for c in cells if a[c] + b[c] < 10]
    pooled_a = Counter({c: a[c] for c in cells if c not in rare})
    pooled_b = Counter({c: b[c] for c in cells if c not in rare})
    if rare:
        pooled_a["rare"], pooled_b["rare"] = sum(a[c] for c in rare), sum(b[c] for c in rare)
    stat = sum(
        (pooled_a[c] - pooled_b[c]) ** 2 / (pooled_a[c] + pooled_b[c])
        for c in pooled_a
        if pooled_a[c] + pooled_b[c]
    )
    return stat, max(len(pooled_a) - 1, 1)


def _samples(llm: LLM, seed_base: int) -> list[tuple[int, ...]]:
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=3, ignore_eos=True, seed=seed_base + i, allowed_token_ids=ALLOWED
        )
        for i in range(SAMPLES)
    ]
    outputs = llm.generate([PROMPT] * SAMPLES, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids[:3]) for o in outputs]  # five sampled: the later two draft too


def _statistics(off: list[tuple[int, ...]], on: list[tuple[int, ...]]) -> dict[str, tuple[float, int]]:
    keys = {
        "token 1": lambda s: s[0],
        "token 2": lambda s: s[1],
        "token 3": lambda s: s[2],
        "tokens 1-2": lambda s: s[:2],
    }
    return {name: _two_sample_chi2(Counter(map(k, off)), Counter(map(k, on))) for name, k in keys.items()}


@pytest.fixture(scope="module")
def samples_off(make_model_dir) -> list[tuple[int, ...]]:
    plain = LLM(str(make_model_dir("qwen3")), block_size=16, enable_prefix_caching=False, max_num_seqs=64)
    return _samples(plain, 0)


@pytest.mark.parametrize(
    ("method", "biased"),
    [
        pytest.param("ngram", False, id="ngram-exact"),
        pytest.param("ngram", True, id="ngram-biased-rule-is-caught"),
        pytest.param("draft_model", False, id="draft_model-exact", marks=pytest.mark.slow),
    ],
)
def test_the_next_three_tokens_are_distributed_as_without_speculation(
    make_model_dir, monkeypatch, samples_off, method, biased
) -> None:
    """``biased``: the runner's acceptance probability ``p`` replaced by ``min(1, 1.5 p)``: the same
    test must then fail (it has the power to see a wrong rule). ``draft_model``: the target drafts for
    itself (greedy drafts, accepted with the probability the target gives them)."""
    if biased:
        monkeypatch.setattr(
            model_runner, "verify", functools.partial(verify, accept_rule=lambda p: min(1.0, 1.5 * p))
        )
    model = str(make_model_dir("qwen3"))
    config: dict = {"method": method, "num_speculative_tokens": 3}
    config.update({"prompt_lookup_min": 1} if method == "ngram" else {"model": model})
    spec = LLM(model, block_size=16, enable_prefix_caching=False, max_num_seqs=64, speculative_config=config)
    off, on = samples_off, _samples(spec, 10**6)
    stats = spec.engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens > 300 and stats.num_draft_tokens - stats.num_accepted_tokens > 300, stats
    results = _statistics(off, on)
    failed = {name: r for name, r in results.items() if r[0] >= _critical(r[1])}
    if biased:
        assert failed, f"a biased acceptance rule went unnoticed: {results}"
    else:
        assert not failed, f"chi-square (statistic, degrees of freedom) at or past p = 0.001: {failed}"
