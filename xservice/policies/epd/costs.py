"""EPD stage costs, workload, SLOs and Algorithm 1's budgets (pure; ``xservice/policies/epd/`` exports them).

- ``StageCosts``: one instance type's measured costs, fitted (``fit_stage_costs``) as encode batch
  ``e0 + e1·patches``, prefill alone ``p0 + p1·L + p2·L²``, decode step ``d0 + d1·B + d2·T`` (B
  sequences attending T context tokens), and transfers ``transfer_s + bytes / transfer_bytes_per_s``
  (image embeddings E→P, KV P→D).
- ``budgets``: HydraInfer's Algorithm 1 τ_e (most images one step may encode) and τ_t (token budget of
  one step: the decodes plus a prefill chunk) that keep a step with ``decode_batch`` ongoing decodes
  under the TPOT SLO, by binary search over any monotone step-time function: the cost model's, or
  real steps timed by ``xllm profile epd``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from xservice.policies.predictors import OnlineLeastSquares

TOKEN_SCALE = 1000.0  # token / patch counts enter the fits in thousands: well-conditioned features


@dataclass(frozen=True)
class StageCosts:
    """What one instance type's stages cost (seconds), as fitted from measurements."""

    encode_s: float  # e0: fixed cost of one vision-encoder batch
    encode_s_per_patch: float  # e1: per encoder input patch (an image has tokens · merge² patches)
    prefill_s: float  # p0: a prefill step's fixed cost
    prefill_s_per_token: float  # p1
    prefill_s_per_token2: float  # p2: attention's quadratic term
    decode_s: float  # d0: a decode step's fixed cost (weights read once, launch, sampling)
    decode_s_per_seq: float  # d1
    decode_s_per_context_token: float  # d2: KV tokens attended
    embed_bytes_per_token: float = 0.0  # one image token's embedding (hidden · dtype bytes)
    kv_bytes_per_token: float = 0.0  # K and V of every layer for one token
    transfer_bytes_per_s: float = 1e9
    transfer_s: float = 0.0  # fixed latency of one transfer
    max_num_seqs: int = 256  # most decodes one instance holds (KV memory, scheduler limit)

    def __post_init__(self) -> None:
        for name in (
            "encode_s", "encode_s_per_patch", "prefill_s", "prefill_s_per_token", "prefill_s_per_token2",
            "decode_s", "decode_s_per_seq", "decode_s_per_context_token", "embed_bytes_per_token",
            "kv_bytes_per_token", "transfer_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"StageCosts.{name} must be a finite number >= 0, got {value}")
        if not self.transfer_bytes_per_s > 0:
            raise ValueError(f"StageCosts.transfer_bytes_per_s must be > 0, got {self.transfer_bytes_per_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"StageCosts.max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def encode_batch_s(self, num_patches: float) -> float:
        """One encoder batch over ``num_patches`` patches (0 patches: no batch, 0 s)."""
        return self.encode_s + self.encode_s_per_patch * num_patches if num_patches > 0 else 0.0

    def prefill_alone_s(self, tokens: float) -> float:
        """A step that only prefills ``tokens`` prompt tokens."""
        if tokens <= 0:
            return 0.0
        return (
            self.prefill_s + self.prefill_s_per_token * tokens + self.prefill_s_per_token2 * tokens * tokens
        )

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        """A step of ``batch`` decodes attending ``context_tokens`` KV tokens in all."""
        if batch <= 0:
            return 0.0
        return (
            self.decode_s + self.decode_s_per_seq * batch + self.decode_s_per_context_token * context_tokens
        )

    def step_s(
        self, batch: float, context_tokens: float, prefill_tokens: float = 0, encode_patches: float = 0
    ) -> float:
        """One Algorithm 1 step: ``batch`` decodes, plus a prefill chunk and/or an encode batch run after
        them (no overlap assumed). A chunk riding with decodes costs its marginal time (``p0`` is paid
        by the step already); its attention over earlier chunks is not modelled."""
        t = self.decode_step_s(batch, context_tokens)
        if prefill_tokens > 0:
            t += self.prefill_alone_s(prefill_tokens) - (self.prefill_s if batch > 0 else 0.0)
        return t + self.encode_batch_s(encode_patches)

    def transfer_time_s(self, num_bytes: float) -> float:
        return self.transfer_s + num_bytes / self.transfer_bytes_per_s if num_bytes > 0 else 0.0

    def state(self) -> dict:
        """JSON-able, with the three models spelt out."""
        return {
            "encode": {
                "model": "encode_s = e0 + e1*patches",
                "coef": [self.encode_s, self.encode_s_per_patch],
            },
            "prefill": {
                "model": "prefill_s = p0 + p1*L + p2*L^2",
                "coef": [self.prefill_s, self.prefill_s_per_token, self.prefill_s_per_token2],
            },
            "decode": {
                "model": "step_s = d0 + d1*B + d2*T",
                "coef": [self.decode_s, self.decode_s_per_seq, self.decode_s_per_context_token],
            },
            "transfer": {
                "embed_bytes_per_token": self.embed_bytes_per_token,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "bytes_per_s": self.transfer_bytes_per_s,
                "latency_s": self.transfer_s,
            },
            "max_num_seqs": self.max_num_seqs,
        }


def fit_stage_costs(
    encode: Sequence[tuple[float, float]],
    prefill: Sequence[tuple[float, float]],
    decode: Sequence[tuple[float, float, float]],
    **transfer: float,
) -> StageCosts:
    """Non-negative least-squares fits of measured samples: ``encode`` as (patches, seconds),
    ``prefill`` as (tokens, seconds), ``decode`` as (batch, context tokens, seconds); ``transfer`` holds
    the other ``StageCosts`` fields. ``ValueError`` when a stage has too few samples."""
    e = _fit([[1.0, p / TOKEN_SCALE] for p, _ in encode], [s for _, s in encode], "encode", 2)
    p = _fit(
        [[1.0, t / TOKEN_SCALE, (t / TOKEN_SCALE) ** 2] for t, _ in prefill],
        [s for _, s in prefill],
        "prefill",
        3,
    )
    d = _fit([[1.0, b, c / TOKEN_SCALE] for b, c, _ in decode], [s for *_, s in decode], "decode", 3)
    return StageCosts(
        e[0], e[1] / TOKEN_SCALE, p[0], p[1] / TOKEN_SCALE, p[2] / TOKEN_SCALE**2,
        d[0], d[1], d[2] / TOKEN_SCALE, **transfer,
    )  # fmt: skip


def _fit(x: list[list[float]], y: list[float], what: str, need: int) -> list[float]:
    if len({tuple(row) for row in x}) < need:
        raise ValueError(
            f"{what}: need samples at >= {need} distinct points to fit, got {len(set(map(tuple, x)))}"
        )
    fit = OnlineLeastSquares(len(x[0]), window=max(1, len(x)), nonnegative=True)
    for row, value in zip(x, y, strict=True):
        fit.add(row, value, seed=True)
    return fit.coef()


# ---------------------------------------------------------------- workload and SLOs
@dataclass(frozen=True)
class EPDWorkload:
    """The requests a deployment is sized for (every request alike: the means of the real mix)."""

    images_per_request: int
    image_tokens_per_image: int  # language-model tokens of one image (after the patch merger)
    patches_per_image: int  # vision-encoder input patches of one image (tokens · merge²)
    prompt_tokens: int  # text tokens of the prompt
    output_tokens: int
    request_rate: float | None = None  # offered requests/s; None: "max", as many as the SLOs allow

    def __post_init__(self) -> None:
        for name in ("images_per_request", "image_tokens_per_image", "patches_per_image", "prompt_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"EPDWorkload.{name} must be >= 0, got {getattr(self, name)}")
        if self.output_tokens < 1:
            raise ValueError(f"EPDWorkload.output_tokens must be >= 1, got {self.output_tokens}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"EPDWorkload.request_rate must be > 0 or None (max), got {self.request_rate}")

    @property
    def prompt_len(self) -> int:
        """Prompt tokens the language model prefills: text plus every image's tokens."""
        return self.prompt_tokens + self.images_per_request * self.image_tokens_per_image

    @property
    def mean_context(self) -> float:
        """Context a decode attends, averaged over its output."""
        return self.prompt_len + self.output_tokens / 2


@dataclass(frozen=True)
class EPDSLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0 seconds, got ttft_s={self.ttft_s} tpot_s={self.tpot_s}")


# ---------------------------------------------------------------- Algorithm 1's budgets
def max_within(step_s: Callable[[int], float], limit_s: float, hi: int, granularity: int = 1) -> int:
    """The largest ``x`` in ``{0, g, 2g, ...} ∩ [0, hi]`` with ``step_s(x) <= limit_s`` (``g`` =
    ``granularity``), by binary search: ``step_s`` must be non-decreasing. ``-1`` when even
    ``step_s(0)`` is over the limit. Each ``x`` is evaluated at most once."""
    if granularity < 1 or hi < 0:
        raise ValueError(f"need granularity >= 1 and hi >= 0, got {granularity}, {hi}")
    seen: dict[int, bool] = {}

    def fits(i: int) -> bool:
        if i not in seen:
            seen[i] = step_s(i * granularity) <= limit_s
        return seen[i]

    if not fits(0):
        return -1
    lo, top = 0, hi // granularity  # fits(lo) holds; the answer is in [lo, top]
    if fits(top):
        return top * granularity
    while top - lo > 1:  # fits(lo) and not fits(top)
        mid = (lo + top) // 2
        lo, top = (mid, top) if fits(mid) else (lo, mid)
    return lo * granularity


@dataclass(frozen=True)
class Budgets:
    """Algorithm 1's per-step budgets under a TPOT SLO, for ``decode_batch`` ongoing decodes.

    Engine config: ``scheduler.max_encode_images`` = τ_e, ``scheduler.max_encode_tokens`` =
    τ_e · image tokens, ``scheduler.max_num_batched_tokens`` = τ_t."""

    decode_batch: int
    max_encode_images: int  # τ_e; 0: not even one image fits beside the decodes
    max_num_batched_tokens: int  # τ_t: decode tokens + prefill chunk tokens; 0: the decodes alone exceed
    decode_only_s: float  # the step with only the decodes
    probes: tuple[tuple[str, int, float], ...] = field(default=(), compare=False)  # (kind, x, step seconds)

    @property
    def feasible(self) -> bool:
        """The decodes alone fit under the SLO."""
        return self.max_num_batched_tokens > 0 or self.decode_batch == 0

    @property
    def max_prefill_chunk(self) -> int:
        return max(0, self.max_num_batched_tokens - self.decode_batch)


def budgets(
    costs: StageCosts | None,
    tpot_slo_s: float,
    decode_batch: int,
    *,
    context_tokens: float = 0.0,
    patches_per_image: float = 1.0,
    encode_step: Callable[[int], float] | None = None,
    prefill_step: Callable[[int], float] | None = None,
    max_images: int = 256,
    max_tokens: int = 65536,
    token_granularity: int = 1,
) -> Budgets:
    """τ_e and τ_t for ``decode_batch`` decodes attending ``context_tokens`` in all.

    ``encode_step(k)``: seconds of a step with the decodes and ``k`` image encodes; ``prefill_step(t)``:
    with the decodes and a ``t``-token prefill chunk. Both default to ``costs``' model (images of
    ``patches_per_image``); pass timed real steps to search over measurements. τ_t is searched in
    multiples of ``token_granularity`` prefill tokens, up to ``max_tokens``; τ_e up to ``max_images``."""
    if tpot_slo_s <= 0 or decode_batch < 0:
        raise ValueError(f"need tpot_slo_s > 0 and decode_batch >= 0, got {tpot_slo_s}, {decode_batch}")
    probes: list[tuple[str, int, float]] = []

    def timed(kind: str, fn: Callable[[int], float]) -> Callable[[int], float]:
        def run(x: int) -> float:
            s = fn(x)
            probes.append((kind, x, s))
            return s

        return run

    if encode_step is None or prefill_step is None:
        if costs is None:
            raise ValueError("budgets needs costs, or both encode_step and prefill_step")
        b, c, g = decode_batch, context_tokens, patches_per_image
        encode_step = encode_step or (lambda k: costs.step_s(b, c, encode_patches=k * g))
        prefill_step = prefill_step or (lambda t: costs.step_s(b, c, prefill_tokens=t))
    chunk = max_within(timed("prefill", prefill_step), tpot_slo_s, max_tokens, token_granularity)
    decode_only = next((s for kind, x, s in probes if x == 0), 0.0)
    if chunk < 0:  # the decodes alone are over the SLO: no budget at all
        return Budgets(decode_batch, 0, 0, decode_only, tuple(probes))
    measure_encode = timed("encode", encode_step)
    # x = 0 is the decode-only step the token search measured already: one baseline for both searches
    images = max_within(
        lambda k: measure_encode(k) if k else _record(probes, decode_only), tpot_slo_s, max_images
    )
    return Budgets(decode_batch, max(images, 0), decode_batch + chunk, decode_only, tuple(probes))


def _record(probes: list[tuple[str, int, float]], decode_only: float) -> float:
    probes.append(("encode", 0, decode_only))
    return decode_only
