"""Sampler tests on random logits (pure torch, CPU)."""

from __future__ import annotations

import pytest
import torch

from xengine.api.messages import SamplingParams
from xengine.sampling.metadata import SamplingMetadata
from xengine.sampling.sampler import Sampler

CPU = torch.device("cpu")
V = 32


def make_meta(batch: int, **kw) -> SamplingMetadata:
    """Metadata with every stage off (all random at temperature 1) unless overridden."""
    fields = dict(
        temperature=torch.ones(batch),
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        all_greedy=False,
        all_random=True,
        repetition_penalty=None,
        presence_penalty=None,
        frequency_penalty=None,
        prompt_token_ids=None,
        output_token_ids=[[] for _ in range(batch)],
        banned_token_ids=None,
        max_num_logprobs=None,
    )
    fields.update(kw)
    return SamplingMetadata(**fields)


def seeded_logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def empirical(logits_row: torch.Tensor, num_draws: int, **kw) -> torch.Tensor:
    """Frequencies of each token over ``num_draws`` rows of the same logits (global RNG, seeded)."""
    logits = logits_row.expand(num_draws, -1).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        tokens = Sampler()(logits, make_meta(num_draws, **kw)).sampled_token_ids
    return torch.bincount(tokens, minlength=logits.shape[1]).float() / num_draws


def test_greedy_is_argmax():
    logits = seeded_logits(6)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1.0  # tie: lowest index wins
    meta = make_meta(6, temperature=torch.zeros(6), all_greedy=True, all_random=False)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=1).tolist()
    assert out.sampled_token_ids[2].item() == 5
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_keeps_only_the_k_best():
    logits = seeded_logits(4)
    top_k = torch.tensor([1, 3, 0, 5])
    allowed = [set(torch.topk(logits[i], int(k)).indices.tolist()) for i, k in enumerate(top_k) if k > 0]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(200):
            tokens = Sampler()(logits, make_meta(4, top_k=top_k, max_top_k=5)).sampled_token_ids.tolist()
            assert tokens[0] in allowed[0] and tokens[1] in allowed[1] and tokens[3] in allowed[2]
    # top-1 is greedy; the disabled row reaches outside the top 5 at some point
    freq = empirical(logits[2], 4000, top_k=torch.zeros(4000, dtype=torch.int64))
    assert freq[torch.topk(logits[2], V - 5, largest=False).indices].sum() > 0


def test_top_k_without_host_max_matches():
    logits = seeded_logits(3)
    top_k = torch.tensor([2, 0, 4])
    g = [torch.Generator().manual_seed(s) for s in range(3)]
    g2 = [torch.Generator().manual_seed(s) for s in range(3)]
    a = Sampler()(logits, make_meta(3, top_k=top_k, max_top_k=4, generators=dict(enumerate(g))))
    b = Sampler()(logits, make_meta(3, top_k=top_k, generators=dict(enumerate(g2))))
    assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)


def test_top_p_matches_renormalised_nucleus():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    probs = logits.softmax(0)
    top_p = 0.8
    # smallest prefix (descending) whose mass reaches top_p
    cum = probs.cumsum(0)
    keep = int((cum < top_p).sum().item()) + 1
    expected = torch.zeros_like(probs)
    expected[:keep] = probs[:keep] / probs[:keep].sum()
    n = 20000
    freq = empirical(logits, n, top_p=torch.full((n,), top_p))
    assert torch.all(freq[keep:] == 0)
    assert torch.allclose(freq, expected, atol=0.02)


def test_top_p_always_keeps_one_token():
    logits = seeded_logits(2)
    meta = make_meta(2, top_p=torch.tensor([1e-6, 1e-6]))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(20):
            assert Sampler()(logits, meta).sampled_token_ids.tolist() == logits.argmax(1).tolist()


def test_top_k_and_top_p_combined():
    logits = torch.tensor([2.0, 1.9, 1.8, 1.7, -5.0, -5.0])
    n = 20000
    freq = empirical(logits, n, top_k=torch.full((n,), 3), top_p=torch.full((n,), 0.5))
    # after top-3 renormalisation the first two tokens are needed to reach 0.5
    p3 = logits[:3].softmax(0)
    expected = torch.tensor([p3[0], p3[1], 0, 0, 0, 0]) / (p3[0] + p3[1])
    assert torch.allclose(freq, expected, atol=0.02)


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    n = 20000
    freq = empirical(logits, n, min_p=torch.full((n,), 0.3))  # threshold 0.12
    expected = torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0]) / 0.85
    assert torch.all(freq[3:] == 0)
    assert torch.allclose(freq, expected, atol=0.02)


def test_temperature_sharpens_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0])
    n = 20000
    freq = empirical(logits, n, temperature=torch.full((n,), 0.5))
    assert torch.allclose(freq, (logits / 0.5).softmax(0), atol=0.02)


def reference_penalties(logits, prompt, output, rep, pres, freq):
    out = logits.clone()
    for b in range(out.shape[0]):
        for t in set(prompt[b]) | set(output[b]):
            x = out[b, t]
            out[b, t] = x / rep[b] if x > 0 else x * rep[b]
        for t in set(output[b]):
            out[b, t] -= freq[b] * output[b].count(t) + pres[b]
    return out


def test_penalties_match_reference():
    logits = seeded_logits(3)
    prompt = [[1, 2, 2, 7], [], [30, 31]]
    output = [[2, 3, 3, 3], [4, 4, 0], []]
    rep, pres, freq = [1.3, 0.7, 2.0], [0.5, -0.25, 1.0], [0.2, 1.5, -0.4]
    meta = make_meta(
        3,
        temperature=torch.zeros(3),
        all_greedy=True,
        all_random=False,
        repetition_penalty=torch.tensor(rep),
        presence_penalty=torch.tensor(pres),
        frequency_penalty=torch.tensor(freq),
        prompt_token_ids=prompt,
        output_token_ids=output,
        max_num_logprobs=0,
    )
    expected = reference_penalties(logits, prompt, output, rep, pres, freq)
    out = Sampler("processed_logprobs")(logits, meta)
    assert out.sampled_token_ids.tolist() == expected.argmax(1).tolist()
    chosen = expected.log_softmax(1).gather(1, out.sampled_token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, chosen, atol=1e-5)


def test_banned_ids_never_sampled():
    logits = torch.zeros(2, 4)
    logits[:, 3] = 10.0  # the banned eos would win almost always
    meta = make_meta(2, banned_token_ids=[[3, 1], []])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(300):
            assert Sampler()(logits, meta).sampled_token_ids[0].item() in (0, 2)
    greedy = make_meta(
        2, temperature=torch.zeros(2), all_greedy=True, all_random=False, banned_token_ids=[[3], []]
    )
    assert Sampler()(logits, greedy).sampled_token_ids.tolist() == [0, 3]


def _mixed_meta() -> object:
    return make_meta(
        3,
        temperature=torch.tensor([0.0, 0.7, 1.5]),
        all_random=False,
        max_num_logprobs=5,
        top_k=torch.tensor([0, 2, 0]),
        banned_token_ids=[[0], [], [4, 5]],
    )


def _check_reported(out: object, ref: torch.Tensor) -> None:
    assert torch.allclose(out.logprobs, ref.gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == (3, 5) and out.top_logprob_token_ids.dtype == torch.int64
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.allclose(out.top_logprobs, ref.gather(1, out.top_logprob_token_ids))
    assert torch.allclose(out.top_logprobs, torch.topk(ref, 5).values)


def test_raw_logprobs_are_the_models_own():
    """The default mode (vLLM's raw_logprobs): the log-softmax of the logits before bans, penalties,
    temperature and top-k; ``raw_logits`` the logits themselves."""
    logits = seeded_logits(3)
    out = Sampler()(logits, _mixed_meta())
    assert out.sampled_token_ids[2].item() not in (4, 5)  # sampled from the processed distribution
    _check_reported(out, logits.log_softmax(1))
    _check_reported(Sampler("raw_logits")(logits, _mixed_meta()), logits)


def test_processed_logprobs_are_what_the_token_is_drawn_from():
    """processed_*: after bans, and for the sampled rows temperature and top-k (cut ids -inf)."""
    logits = seeded_logits(3)
    processed = logits.clone()
    processed[0, 0] = processed[2, 4] = processed[2, 5] = float("-inf")
    drawn = processed.clone()
    drawn[1] = drawn[1] / 0.7
    drawn[1][drawn[1] < torch.topk(drawn[1], 2).values[-1]] = float("-inf")
    drawn[2] = drawn[2] / 1.5
    out = Sampler("processed_logprobs")(logits, _mixed_meta())
    ref = drawn.log_softmax(1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    assert torch.isinf(out.top_logprobs[1, 2:]).all()  # row 1 keeps two ids
    assert torch.allclose(out.top_logprobs[:, :2], torch.topk(ref, 2).values)
    logits_out = Sampler("processed_logits")(logits, _mixed_meta())
    assert torch.allclose(logits_out.top_logprobs[:, :2], torch.topk(drawn, 2).values)


def test_zero_logprobs_returns_chosen_only():
    meta = make_meta(2, max_num_logprobs=0)
    out = Sampler()(seeded_logits(2), meta)
    assert out.logprobs.shape == (2,) and out.top_logprobs.shape == (2, 0)


def run_seeded(batch_logits: list[torch.Tensor], rows: dict[int, int], steps: int) -> dict[int, list[int]]:
    """Sample ``steps`` times; ``rows`` maps row -> seed. Returns row -> tokens."""
    gens = {row: torch.Generator().manual_seed(seed) for row, seed in rows.items()}
    logits = torch.stack(batch_logits)
    b = logits.shape[0]
    tokens: dict[int, list[int]] = {row: [] for row in rows}
    for _ in range(steps):
        meta = make_meta(
            b,
            generators=gens,
            top_k=torch.full((b,), 20),
            top_p=torch.full((b,), 0.9),
            temperature=torch.full((b,), 1.3),
        )
        out = Sampler()(logits, meta).sampled_token_ids
        for row in rows:
            tokens[row].append(out[row].item())
    return tokens


def test_seeded_rows_independent_of_batch_composition():
    target = seeded_logits(1, seed=7)[0]
    others = seeded_logits(5, seed=8)
    alone = run_seeded([target], {0: 42}, steps=6)[0]
    crowded = run_seeded([others[0], others[1], target, others[2]], {2: 42, 0: 3}, steps=6)[2]
    moved = run_seeded([target, *others], {0: 42, 4: 9}, steps=6)[0]
    assert alone == crowded == moved
    assert len(set(alone)) > 1  # actually random, not collapsed to argmax
    assert run_seeded([target], {0: 43}, steps=6)[0] != alone


def test_mixed_greedy_and_random_batch():
    logits = seeded_logits(4)
    greedy_rows = [0, 3]
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.0])
    meta = make_meta(4, temperature=temperature, all_random=False, top_p=torch.tensor([1.0, 0.5, 1.0, 1.0]))
    seen_random = set()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(50):
            out = Sampler()(logits, meta).sampled_token_ids
            assert [out[i].item() for i in greedy_rows] == [logits[i].argmax().item() for i in greedy_rows]
            seen_random.add(out[2].item())
    assert len(seen_random) > 1


@pytest.mark.parametrize("top_k", [-1, 0])
def test_from_params_disabled_defaults(top_k):
    params = [SamplingParams(top_k=top_k), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.from_params(params, [[], [5]], [[1], [2]], {}, eos_token_ids=[0], device=CPU)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert (
        meta.repetition_penalty is None and meta.presence_penalty is None and meta.frequency_penalty is None
    )
    assert meta.prompt_token_ids is None and meta.banned_token_ids is None and meta.max_num_logprobs is None
    assert meta.temperature.tolist() == [1.0, 0.0]
    assert not meta.all_greedy and not meta.all_random


def test_from_params_builds_tensors():
    params = [
        SamplingParams(
            top_k=-1, top_p=0.9, min_tokens=3, stop_token_ids=[7], logprobs=2, repetition_penalty=1.2
        ),
        SamplingParams(top_k=5, min_p=0.1, min_tokens=1, logprobs=4, presence_penalty=0.5),
        SamplingParams(temperature=0.0, top_k=3, frequency_penalty=-0.5, min_tokens=2, ignore_eos=True),
    ]
    outputs = [[1, 2], [1], []]
    prompts = [[9], [8], [7]]
    gen = torch.Generator().manual_seed(1)
    meta = SamplingMetadata.from_params(params, outputs, prompts, {0: gen}, eos_token_ids=[2, 0], device=CPU)
    assert meta.top_k.tolist() == [0, 5, 0]  # -1 disabled; greedy rows ignore truncation
    assert meta.max_top_k == 5
    assert meta.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert meta.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert meta.repetition_penalty.tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert meta.presence_penalty.tolist() == [0.0, 0.5, 0.0]
    assert meta.frequency_penalty.tolist() == [0.0, 0.0, -0.5]
    assert meta.prompt_token_ids == prompts and meta.output_token_ids == outputs
    assert meta.banned_token_ids == [[0, 2, 7], [], [0, 2]]  # row 1 reached min_tokens
    assert meta.max_num_logprobs == 4
    assert meta.generators == {0: gen}
    assert meta.temperature.dtype == torch.float32 and meta.top_k.dtype == torch.int64
    assert not meta.all_greedy and not meta.all_random
    out = Sampler()(seeded_logits(3), meta)
    assert out.sampled_token_ids.shape == (3,) and out.top_logprobs.shape == (3, 4)
    assert out.sampled_token_ids[2].item() not in (0, 2)


def test_from_params_all_greedy():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)]
    meta = SamplingMetadata.from_params(params, [[], []], [[], []], {}, eos_token_ids=[], device=CPU)
    assert meta.all_greedy and not meta.all_random and meta.max_num_logprobs == 0


def test_inverse_cdf_draws_match_the_distribution_and_never_a_zero():
    """The draw inverts each row's CDF: frequencies follow the probabilities over a large vocabulary,
    and tokens of probability 0 (at either end, or masked in between) are never drawn."""
    from xengine.sampling.sampler import inverse_cdf_sample

    vocab, n = 4096, 20000
    probs = torch.zeros(vocab)
    probs[1:9] = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05])
    probs[vocab - 2] = 1e-3  # unnormalised rows are fine: the draw scales by the row's sum
    rows = probs.expand(n, -1).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(5)
        drawn = inverse_cdf_sample(rows, {})
    freq = torch.bincount(drawn, minlength=vocab).float() / n
    assert torch.allclose(freq, probs / probs.sum(), atol=0.01)
    assert freq[probs == 0].sum() == 0
    gen = {0: torch.Generator().manual_seed(3)}
    again = {0: torch.Generator().manual_seed(3)}
    assert inverse_cdf_sample(rows[:4], gen)[0] == inverse_cdf_sample(rows[:4], again)[0]
