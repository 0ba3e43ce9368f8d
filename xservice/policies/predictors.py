"""Per-instance latency models fitted online from what engines report (pure, no I/O, numpy only).

Dynamic PD disaggregation (xLLM report §3.2) decides where a request goes, and when an instance flips
role, from predicted latencies rather than queue lengths:

- ``TTFTPredictor``: an instance's prefill compute time as a quadratic in the uncached prompt tokens
  ``L`` (linear layers are linear in ``L``, attention adds the ``L²`` term); TTFT = queue time + that.
- ``TPOTPredictor``: an instance's step time as ``a + b·B + c·T + d·P`` (sequences, context tokens
  attended over, prefill tokens riding in the step); a decode's TPOT is the step time of its batch.

Both are seeded by start-up profiling (``seed=True`` samples, kept forever) and then follow the
instance through a sliding window of recent samples, so a regime change (another model load, thermal
throttling, a noisy neighbour) is learnt within ``window`` samples while the profile keeps the fit
anchored where no recent sample lies. Each tracks its relative prediction error (an EWMA) so the
service can export how far to trust it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ERROR_ALPHA = 0.1  # EWMA weight of the newest relative error
MIN_ACTUAL_S = 1e-3  # relative errors divide by at least this: near-zero actuals do not explode them
TOKEN_SCALE = 1000.0  # token counts enter the fits in thousands: well-conditioned features


class OnlineLeastSquares:
    """y ≈ coef · x, fitted by least squares over the seed samples plus a sliding window of the most recent
    online samples (``window``), refitted lazily on predict when new samples arrived.

    Seed and window samples weigh the same. ``ridge`` adds ``ridge·|coef|²`` to the loss: negligible when
    the samples determine the fit, and it picks (close to) the minimum-norm solution when they do not
    (fewer samples than features, collinear features), so predictions in the sampled regime stay right.

    ``nonnegative``: every coefficient is a cost (seconds per token, per sequence, ...), so the fit is
    constrained to ``coef >= 0`` (exact non-negative least squares: the best fit over the subsets of
    features left free, fine for the few features these models have). Noisy samples then cannot
    produce a curve that dips (a negative linear term under a positive quadratic one predicting
    near-zero prefill time mid-range).
    """

    def __init__(
        self, num_features: int, window: int = 256, ridge: float = 1e-6, nonnegative: bool = False
    ) -> None:
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1, got {num_features}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {ridge}")
        self.num_features = num_features
        self.window = window
        self._seed_rows: list[list[float]] = []  # [x..., y]
        self._ring = np.zeros((window, num_features + 1))  # online [x..., y], overwritten oldest first
        self._num_online = 0
        self._next = 0
        self._ridge_rows = math.sqrt(ridge) * np.eye(num_features) if ridge > 0 else None
        self._coef = [0.0] * num_features
        self._dirty = False
        self.nonnegative = nonnegative

    def add(self, x: Sequence[float], y: float, seed: bool = False) -> None:
        """One sample; ``seed`` ones (start-up profiling) are kept forever, online ones only in the window."""
        if len(x) != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {len(x)}")
        row = [float(v) for v in x] + [float(y)]
        if not all(math.isfinite(v) for v in row):
            raise ValueError(f"non-finite sample x={list(x)} y={y}")
        if seed:
            self._seed_rows.append(row)
        else:
            self._ring[self._next] = row
            self._next = (self._next + 1) % self.window
            self._num_online = min(self._num_online + 1, self.window)
        self._dirty = True

    @property
    def num_samples(self) -> int:
        """Samples the fit uses: all seeds plus the online ones still in the window."""
        return len(self._seed_rows) + self._num_online

    def coef(self) -> list[float]:
        """The fitted coefficients (zeros when there is no sample)."""
        if self._dirty:
            self._refit()
        return list(self._coef)

    def predict(self, x: Sequence[float]) -> float:
        if self._dirty:
            self._refit()
        return math.fsum(c * float(v) for c, v in zip(self._coef, x, strict=True))

    def _refit(self) -> None:
        self._dirty = False
        parts = [self._ring[: self._num_online]]
        if self._seed_rows:
            parts.append(np.asarray(self._seed_rows))
        data = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if len(data) == 0:
            self._coef = [0.0] * self.num_features
            return
        a, b = data[:, :-1], data[:, -1]
        if self._ridge_rows is not None:
            a = np.concatenate([a, self._ridge_rows])
            b = np.concatenate([b, np.zeros(self.num_features)])
        solution = np.linalg.lstsq(a, b, rcond=None)[0]
        if self.nonnegative and (solution < 0).any():
            solution = _nonnegative_lstsq(a, b)
        self._coef = [float(c) for c in solution]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a·x - b| subject to x >= 0, by trying every subset of free features (few features)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b * b))
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        x = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (x < 0).any():
            continue
        err = float(np.sum((a[:, cols] @ x - b) ** 2))
        if err < best_err:
            full = np.zeros(n)
            full[cols] = x
            best, best_err = full, err
    return best


class _ErrorTracker:
    """EWMA of the relative error ``|predicted - actual| / max(actual, 1e-3)``; None before the first."""

    def __init__(self) -> None:
        self.value: float | None = None

    def record(self, predicted_s: float, actual_s: float) -> None:
        rel = abs(predicted_s - actual_s) / max(actual_s, MIN_ACTUAL_S)
        if not math.isfinite(rel):
            raise ValueError(f"non-finite error sample predicted={predicted_s} actual={actual_s}")
        self.value = rel if self.value is None else (1 - ERROR_ALPHA) * self.value + ERROR_ALPHA * rel


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")


class _Predictor:
    """What both predictors share: a least-squares fit, its error EWMA, and readiness."""

    MIN_SAMPLES = 1
    _fit: OnlineLeastSquares
    _error: _ErrorTracker

    @property
    def error(self) -> float | None:
        return self._error.value

    @property
    def num_samples(self) -> int:
        return self._fit.num_samples

    @property
    def ready(self) -> bool:
        return self.num_samples >= self.MIN_SAMPLES


class TTFTPredictor(_Predictor):
    """Prefill compute time of an instance as a quadratic in uncached prompt tokens: a + b·L + c·L²;
    predicted TTFT = queue_s + compute_s(L).

    ``error`` is one EWMA fed by two sources: ``observe`` records the compute model's error on each new
    sample before learning from it (once ``ready``), and ``record_error`` lets the service add its
    end-to-end TTFT predictions (queue time included) against the TTFT it then measured.
    """

    MIN_SAMPLES = 3  # a quadratic has three coefficients

    def __init__(self, window: int = 256) -> None:
        self._fit = OnlineLeastSquares(3, window, nonnegative=True)
        self._error = _ErrorTracker()

    @staticmethod
    def _features(uncached_tokens: int) -> list[float]:
        k = uncached_tokens / TOKEN_SCALE
        return [1.0, k, k * k]

    def observe(self, uncached_tokens: int, compute_s: float, seed: bool = False) -> None:
        """A prefill of ``uncached_tokens`` took ``compute_s``; ``seed`` for start-up profiling samples."""
        _check_count("uncached_tokens", uncached_tokens)
        _check_seconds("compute_s", compute_s)
        if self.ready:
            self._error.record(self.compute_s(uncached_tokens), compute_s)
        self._fit.add(self._features(uncached_tokens), compute_s, seed=seed)

    def compute_s(self, uncached_tokens: int) -> float:
        """Predicted prefill compute seconds (never negative; 0.0 with no sample)."""
        return max(0.0, self._fit.predict(self._features(uncached_tokens)))

    def predict(self, uncached_tokens: int, queue_s: float = 0.0) -> float:
        """Predicted TTFT: ``queue_s`` (time until the prefill starts) plus the compute time."""
        return queue_s + self.compute_s(uncached_tokens)

    def record_error(self, predicted_s: float, actual_s: float) -> None:
        """A TTFT predicted earlier against the TTFT measured; feeds the same EWMA as ``observe``."""
        self._error.record(predicted_s, actual_s)

    def state(self) -> dict:
        """JSON-able model state; coefficients in seconds per token (per token² for ``c``)."""
        a, b, c = self._fit.coef()
        return {
            "model": "ttft_s = a + b*L + c*L^2",
            "coef": [a, b / TOKEN_SCALE, c / TOKEN_SCALE**2],
            "num_samples": self.num_samples,
            "error": self.error,
        }


class TPOTPredictor(_Predictor):
    """Step time of an instance's batch: a + b·B + c·T + d·P, B = sequences in the step, T = context tokens
    (KV tokens the step attends over, thousands-scaled internally), P = prefill tokens in the step (0 for a
    decode-only step). TPOT of a decode in that batch = the step time.

    ``error`` is the EWMA of the model's relative error on each observed step, measured before the step
    is learnt from (once ``ready``).
    """

    MIN_SAMPLES = 4  # four coefficients

    def __init__(self, window: int = 256) -> None:
        self._fit = OnlineLeastSquares(4, window, nonnegative=True)
        self._error = _ErrorTracker()

    @staticmethod
    def _features(batch_size: float, context_tokens: float, prefill_tokens: float) -> list[float]:
        return [1.0, float(batch_size), context_tokens / TOKEN_SCALE, prefill_tokens / TOKEN_SCALE]

    def observe(
        self, batch_size: int, context_tokens: int, step_s: float, prefill_tokens: int = 0, seed: bool = False
    ) -> None:
        """A step over ``batch_size`` sequences took ``step_s``; ``seed`` for start-up profiling samples."""
        _check_count("batch_size", batch_size)
        _check_count("context_tokens", context_tokens)
        _check_count("prefill_tokens", prefill_tokens)
        _check_seconds("step_s", step_s)
        if self.ready:
            self._error.record(self.predict(batch_size, context_tokens, prefill_tokens), step_s)
        self._fit.add(self._features(batch_size, context_tokens, prefill_tokens), step_s, seed=seed)

    def predict(self, batch_size: float, context_tokens: float, prefill_tokens: float = 0) -> float:
        """Predicted step seconds (never negative; 0.0 with no sample); a mean batch may be fractional."""
        return max(0.0, self._fit.predict(self._features(batch_size, context_tokens, prefill_tokens)))

    def state(self) -> dict:
        """JSON-able model state; ``c`` and ``d`` in seconds per token."""
        a, b, c, d = self._fit.coef()
        return {
            "model": "step_s = a + b*B + c*T + d*P",
            "coef": [a, b, c / TOKEN_SCALE, d / TOKEN_SCALE],
            "num_samples": self.num_samples,
            "error": self.error,
        }
