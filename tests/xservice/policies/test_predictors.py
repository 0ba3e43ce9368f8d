"""Online latency predictors (TTFT quadratic, TPOT linear): fits, sliding window, seeds, error EWMA."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from xservice.policies.predictors import OnlineLeastSquares, TPOTPredictor, TTFTPredictor


def ttft_truth(tokens: int) -> float:
    return 0.02 + 3e-5 * tokens + 4e-9 * tokens * tokens


def tpot_truth(batch: int, context: int, prefill: int = 0) -> float:
    return 0.01 + 2e-4 * batch + 1.5e-6 * context + 5e-5 * prefill


def test_least_squares_recovers_coefficients_and_is_zero_without_samples() -> None:
    fit = OnlineLeastSquares(2)
    assert fit.num_samples == 0
    assert fit.coef() == [0.0, 0.0]
    assert fit.predict([1.0, 5.0]) == 0.0
    for x in range(10):
        fit.add([1.0, x], 3.0 - 0.5 * x)
    assert fit.coef() == pytest.approx([3.0, -0.5], abs=1e-5)  # the tiny ridge biases by ~1e-6
    assert fit.predict([1.0, 20.0]) == pytest.approx(-7.0, abs=1e-5)  # the raw fit does not clamp
    with pytest.raises(ValueError, match="features"):
        fit.add([1.0], 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        fit.add([1.0, 2.0], math.nan)


def test_least_squares_window_drops_old_online_samples_but_keeps_seeds() -> None:
    fit = OnlineLeastSquares(1, window=4)
    fit.add([1.0], 10.0, seed=True)
    for _ in range(6):
        fit.add([1.0], 0.0)
    assert fit.num_samples == 5  # 1 seed + a full window of 4
    assert fit.coef()[0] == pytest.approx(2.0)  # mean of the seed (10) and four zeros
    for _ in range(4):
        fit.add([1.0], 5.0)
    assert fit.coef()[0] == pytest.approx(6.0)  # the zeros slid out: mean of 10, 5, 5, 5, 5


def test_ttft_recovers_a_quadratic_exactly_from_noiseless_samples() -> None:
    pred = TTFTPredictor()
    assert not pred.ready
    for tokens in (0, 256, 1024, 4096, 16384):
        pred.observe(tokens, ttft_truth(tokens))
    assert pred.ready
    assert pred.state()["coef"] == pytest.approx([0.02, 3e-5, 4e-9], rel=1e-4)
    for tokens in (100, 3000, 20000):
        assert pred.compute_s(tokens) == pytest.approx(ttft_truth(tokens), rel=1e-5)
    assert pred.predict(3000, queue_s=0.5) == pytest.approx(0.5 + ttft_truth(3000), rel=1e-5)
    assert pred.error == pytest.approx(0.0, abs=1e-3)  # two samples were scored by an exact model


def test_ttft_with_noise_predicts_within_tolerance() -> None:
    rng = np.random.default_rng(0)
    pred = TTFTPredictor()
    for tokens in rng.integers(1, 8192, size=200):
        pred.observe(int(tokens), ttft_truth(int(tokens)) * (1 + rng.normal(0, 0.05)))
    for tokens in (500, 2000, 6000):
        assert pred.compute_s(tokens) == pytest.approx(ttft_truth(tokens), rel=0.03)
    assert 0.01 < pred.error < 0.1  # about the 5% noise (mean |N(0, .05)| ≈ 0.04)


def test_ttft_seeds_alone_predict_and_survive_a_regime_change_in_the_window() -> None:
    pred = TTFTPredictor(window=32)
    for tokens in (128, 1024, 4096, 8192):
        pred.observe(tokens, ttft_truth(tokens), seed=True)
    assert pred.num_samples == 4
    assert pred.compute_s(2048) == pytest.approx(ttft_truth(2048), rel=1e-5)

    def slow(tokens: int) -> float:
        return 3 * ttft_truth(tokens)

    for i in range(200):  # the instance became 3x slower (e.g. a co-located job)
        tokens = 256 + (997 * i) % 8000
        pred.observe(tokens, slow(tokens))
    assert pred.num_samples == 4 + 32
    # the window's 32 samples outweigh the 4 seeds: close to the new regime, not the old one
    for tokens in (2048, 4096):
        assert pred.compute_s(tokens) == pytest.approx(slow(tokens), rel=0.15)


def test_ttft_window_forgets_the_old_online_regime_entirely() -> None:
    pred = TTFTPredictor(window=16)
    for i in range(16):
        pred.observe(100 * (i + 1), 10 * ttft_truth(100 * (i + 1)))
    for i in range(16):
        pred.observe(100 * (i + 1), ttft_truth(100 * (i + 1)))
    assert pred.compute_s(800) == pytest.approx(ttft_truth(800), rel=1e-5)


def test_ttft_fit_is_nonnegative_and_never_falls_with_length() -> None:
    pred = TTFTPredictor()
    for tokens in (0, 1000, 2000, 3000):  # decreasing with L: costs cannot be negative, the fit is flat
        pred.observe(tokens, 0.3 - 1e-4 * tokens)
    assert all(c >= 0 for c in pred.state()["coef"])
    assert pred.compute_s(10000) == pytest.approx(pred.compute_s(0)) == pytest.approx(0.15)
    # noisy samples that an unconstrained quadratic fits with a negative linear term (a dip mid-range)
    noisy = TTFTPredictor()
    for tokens, s in ((16, 0.012), (64, 0.004), (256, 0.010), (512, 0.030), (1024, 0.090)):
        noisy.observe(tokens, s)
    lengths = range(0, 1100, 50)
    assert all(noisy.compute_s(a) <= noisy.compute_s(b) for a, b in zip(lengths, lengths[1:]))
    assert TTFTPredictor().compute_s(1000) == 0.0  # no sample
    assert TTFTPredictor().predict(1000, queue_s=0.1) == pytest.approx(0.1)


def test_ttft_record_error_ewma() -> None:
    pred = TTFTPredictor()
    assert pred.error is None
    for _ in range(50):
        pred.record_error(1.0, 1.0)
    assert pred.error == pytest.approx(0.0)
    pred.record_error(1.5, 1.0)  # one 50% miss moves the EWMA by alpha * 0.5
    assert pred.error == pytest.approx(0.05)
    for _ in range(200):
        pred.record_error(1.2, 1.0)
    assert pred.error == pytest.approx(0.2, rel=1e-6)
    pred.record_error(0.01, 0.0)  # actual ~0: divides by 1 ms, stays finite
    assert math.isfinite(pred.error)


def test_ttft_observe_tracks_a_biased_model() -> None:
    pred = TTFTPredictor()
    for tokens in (1000, 2000, 4000):
        pred.observe(tokens, ttft_truth(tokens), seed=True)
    assert pred.error is None  # not ready before the third sample: nothing was scored
    for _ in range(100):  # a steady 2x slowdown the 3 seeds keep from being fully learnt
        pred.observe(3000, 2 * ttft_truth(3000))
    assert pred.error is not None and pred.error > 0
    assert pred.compute_s(3000) == pytest.approx(2 * ttft_truth(3000), rel=0.05)


def test_predictors_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="uncached_tokens"):
        TTFTPredictor().observe(-1, 0.1)
    with pytest.raises(ValueError, match="compute_s"):
        TTFTPredictor().observe(10, -0.1)
    with pytest.raises(ValueError, match="step_s"):
        TPOTPredictor().observe(1, 10, math.inf)
    with pytest.raises(ValueError, match="window"):
        TPOTPredictor(window=0)


def test_tpot_recovers_linear_coefficients_exactly() -> None:
    pred = TPOTPredictor()
    samples = [(1, 500, 0), (8, 12000, 0), (32, 70000, 0), (16, 20000, 2048), (4, 3000, 512), (64, 1000, 0)]
    for batch, context, prefill in samples:
        pred.observe(batch, context, tpot_truth(batch, context, prefill), prefill_tokens=prefill)
    assert pred.ready
    assert pred.state()["coef"] == pytest.approx([0.01, 2e-4, 1.5e-6, 5e-5], rel=1e-4)
    assert pred.predict(48, 100000) == pytest.approx(tpot_truth(48, 100000), rel=1e-5)
    assert pred.predict(2, 4000, prefill_tokens=1000) == pytest.approx(tpot_truth(2, 4000, 1000), rel=1e-5)
    assert pred.error == pytest.approx(0.0, abs=1e-3)


def test_tpot_with_noise_and_error_reflects_noise() -> None:
    rng = np.random.default_rng(1)
    pred = TPOTPredictor()
    for _ in range(256):
        batch = int(rng.integers(1, 64))
        context = int(batch * rng.integers(100, 4000))
        prefill = int(rng.choice([0, 0, 0, rng.integers(1, 2048)]))
        pred.observe(batch, context, tpot_truth(batch, context, prefill) * (1 + rng.normal(0, 0.03)), prefill)
    assert pred.predict(32, 64000) == pytest.approx(tpot_truth(32, 64000), rel=0.03)
    assert pred.predict(8, 8000, 1024) == pytest.approx(tpot_truth(8, 8000, 1024), rel=0.03)
    assert 0.005 < pred.error < 0.06


def test_tpot_rank_deficient_decode_only_samples_predict_the_seen_regime() -> None:
    pred = TPOTPredictor()
    for batch in (1, 2, 4, 8, 16, 32):  # every sequence holds exactly 1000 tokens: T = 1000 * B, P = 0
        pred.observe(batch, 1000 * batch, tpot_truth(batch, 1000 * batch))
    for batch in (3, 12, 24, 48):
        assert pred.predict(batch, 1000 * batch) == pytest.approx(tpot_truth(batch, 1000 * batch), rel=1e-5)
    coef = pred.state()["coef"]
    assert all(math.isfinite(c) for c in coef)
    assert coef[3] == pytest.approx(0.0, abs=1e-9)  # no prefill was seen: the ridge keeps d at zero


def test_tpot_seeds_alone_and_clamp() -> None:
    pred = TPOTPredictor(window=8)
    assert pred.predict(8, 8000) == 0.0
    for batch, context in ((1, 100), (8, 4000), (32, 40000), (16, 1000)):
        pred.observe(batch, context, tpot_truth(batch, context), seed=True)
    assert pred.ready and pred.num_samples == 4
    assert pred.predict(24, 20000) == pytest.approx(tpot_truth(24, 20000), rel=1e-5)
    for batch in range(1, 9):  # falling with the batch size: no cost is negative, so never below zero
        pred.observe(batch, 0, 0.5 - 0.05 * batch)
    assert all(c >= 0 for c in pred.state()["coef"]) and pred.predict(200, 0) >= 0.0


def test_tpot_window_adapts_after_a_regime_change() -> None:
    pred = TPOTPredictor(window=64)
    rng = np.random.default_rng(2)
    batches = rng.integers(1, 64, size=300)
    contexts = rng.integers(100, 3000, size=300)
    for batch, per_seq in zip(batches[:150], contexts[:150], strict=True):
        pred.observe(int(batch), int(batch * per_seq), tpot_truth(int(batch), int(batch * per_seq)))
    before = pred.error
    for batch, per_seq in zip(batches[150:], contexts[150:], strict=True):
        pred.observe(int(batch), int(batch * per_seq), 2 * tpot_truth(int(batch), int(batch * per_seq)))
    assert pred.num_samples == 64
    assert pred.predict(16, 16000) == pytest.approx(2 * tpot_truth(16, 16000), rel=1e-5)
    assert before == pytest.approx(0.0, abs=1e-5)
    assert pred.error > before  # the switch was scored as a miss, then decays


def test_state_is_json_serialisable() -> None:
    ttft, tpot = TTFTPredictor(), TPOTPredictor()
    empty = json.loads(json.dumps(ttft.state()))
    assert empty == {
        "model": "ttft_s = a + b*L + c*L^2",
        "coef": [0.0, 0.0, 0.0],
        "num_samples": 0,
        "error": None,
    }
    for tokens in (100, 200, 400, 800):
        ttft.observe(tokens, ttft_truth(tokens))
        tpot.observe(tokens // 100, tokens * 10, 0.01 * tokens / 100)
    for state in (ttft.state(), tpot.state()):
        assert json.loads(json.dumps(state)) == state
    assert tpot.state()["model"] == "step_s = a + b*B + c*T + d*P"
    assert tpot.state()["num_samples"] == 4 and tpot.state()["error"] is None  # 4th sample: not yet scored
