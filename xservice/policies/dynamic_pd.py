"""Dynamic PD disaggregation (xLLM report §3.2): elastic pools, SLO-aware request scheduling and role flips.

Pure and deterministic over snapshots, so the same code runs in the service and in the cluster
simulator. Instances can both prefill and decode; a role is a service-side attribute, and an
instance's pool is its launch role (``origin``) with its current role. ``select_prefill`` and
``select_decode`` place a request by predicted TTFT / TPOT and KV capacity; ``plan_flips`` lends
instances between the sides under hysteresis. The rules, in order: ``docs/dynamic_pd.md``, "Scheduling".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from xservice.policies.predictors import TPOTPredictor, TTFTPredictor

PREFILL, DECODE = "prefill", "decode"
POOL_P, POOL_D, POOL_P2D, POOL_D2P = "P", "D", "P→D", "D→P"
POOLS = (POOL_P, POOL_D, POOL_P2D, POOL_D2P)
# a capacity flip leaves the prefill side at most this busy (share of time with a prefill in flight)
SPARE_UTILIZATION = 0.7


def pool_of(origin: str, role: str) -> str:
    """The elastic pool of an instance launched as ``origin`` now serving as ``role``."""
    if origin == PREFILL:
        return POOL_P if role == PREFILL else POOL_P2D
    return POOL_D if role == DECODE else POOL_D2P


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class PDInstance:
    """One healthy instance as the scheduler sees it now."""

    name: str
    origin: str  # launch role: prefill | decode
    role: str  # current role: prefill | decode
    queue_s: float = 0.0  # predicted time to work off the prefills already sent there
    num_prefilling: int = 0  # prefills sent there and not finished
    num_decoding: int = 0  # decode sequences running there
    decode_tokens: int = 0  # their context tokens (KV the next step attends over)
    reserved_tokens: int = 0  # KV its placed streams will grow to (prompt + max_tokens each)
    capacity_tokens: int = 1 << 62  # KV tokens it can hold (its pool, minus a margin)
    observed_step_s: float | None = None  # recent observed step time of its decode batches (EWMA)
    prefill_utilization: float = 1.0  # fraction of the last ``idle_s`` it had a prefill in flight
    busy_since: float | None = None  # observed step time over the TPOT SLO since then; None: within it
    last_flip_at: float | None = None
    ttft: TTFTPredictor | None = None
    tpot: TPOTPredictor | None = None

    @property
    def pool(self) -> str:
        return pool_of(self.origin, self.role)

    @property
    def committed_tokens(self) -> int:
        """KV promised to its decode streams: what they will grow to, at least what they hold now."""
        return max(self.reserved_tokens, self.decode_tokens)

    def fits(self, reserve_tokens: int) -> bool:
        return self.committed_tokens + reserve_tokens <= self.capacity_tokens

    def predict_ttft(self, uncached_tokens: int) -> float:
        compute = self.ttft.compute_s(uncached_tokens) if self.ttft is not None else 0.0
        return self.queue_s + compute

    def predict_step(self, extra_seqs: int = 0, extra_tokens: int = 0, prefill_tokens: int = 0) -> float:
        """Step time of its decode batch with ``extra_seqs`` more sequences of ``extra_tokens`` in all,
        in a step that also carries ``prefill_tokens`` of prompt."""
        if self.tpot is None:
            return 0.0
        return self.tpot.predict(
            self.num_decoding + extra_seqs, self.decode_tokens + extra_tokens, prefill_tokens
        )


@dataclass(frozen=True)
class Flip:
    name: str
    to_role: str
    reason: str

    @property
    def direction(self) -> str:
        return "D→P" if self.to_role == PREFILL else "P→D"


@dataclass(frozen=True)
class PrefillChoice:
    name: str | None  # None: no prefill-capable instance at all
    predicted_ttft_s: float = 0.0
    flip: Flip | None = None  # flip this instance to prefill first (then ``name`` is it)
    meets_slo: bool = True


@dataclass(frozen=True)
class DecodeChoice:
    name: str | None
    reason: str = ""
    predicted_step_s: float = 0.0


@dataclass
class FlipHistory:
    """What hysteresis needs to remember between calls (owned by the caller, updated by ``record``)."""

    last_flip_at: float | None = None
    last_direction: str | None = None
    flips: list[Flip] = field(default_factory=list)

    def record(self, flip: Flip, now: float) -> None:
        self.last_flip_at, self.last_direction = now, flip.direction
        self.flips.append(flip)


class DynamicPDPolicy:
    name = "dynamic_pd"

    def __init__(
        self,
        min_decode: int = 2,
        min_prefill: int = 1,
        cooldown_s: float = 5.0,
        min_interval_s: float = 1.0,
        idle_s: float = 3.0,
        idle_utilization: float = 0.2,
        sustain_s: float = 1.0,
        pressure: float = 0.8,
        capacity_pressure: float = 0.9,
        load_factor: float = 1.25,
        backlog: float = 0.3,
        headroom: float = 0.3,
        flip_share: float = 0.05,
    ) -> None:
        if min_decode < 1 or min_prefill < 1:
            raise ValueError("min_decode and min_prefill must be >= 1")
        self.min_decode = min_decode
        self.min_prefill = min_prefill
        self.cooldown_s = cooldown_s
        self.min_interval_s = min_interval_s
        self.idle_s = idle_s  # the window the caller measures ``prefill_utilization`` over
        self.idle_utilization = idle_utilization
        self.sustain_s = sustain_s
        self.pressure = pressure  # idle-prefill flips need a decode batch at this share of the TPOT SLO
        self.capacity_pressure = capacity_pressure  # decode KV committed at this share: flip P→D
        # ... and that slow by its load: at least this times the step its device takes for one sequence
        # (a device whose lone decode step is near the SLO is not helped by more decode instances)
        self.load_factor = load_factor
        # the prefill side queued this share of the TTFT SLO on average: lend it a decode instance now,
        # before arrivals see the SLO missed (the backlog built by then costs the rest)
        self.backlog = backlog
        # a pool's least-queued instance takes a prompt while its predicted TTFT is within this share
        # of the SLO; past it the prefill side's fastest does (a prediction just under the SLO misses
        # it about half the time)
        self.headroom = headroom
        # flips one plan may make at once: this share of the instances (at least one), so a cluster of
        # hundreds follows a shift as fast as one of eight
        self.flip_share = flip_share

    # ------------------------------------------------------------------ hysteresis

    def may_flip(self, inst: PDInstance, to_role: str, history: FlipHistory, now: float) -> bool:
        if inst.role == to_role:
            return False
        if inst.last_flip_at is not None and now - inst.last_flip_at < self.cooldown_s:
            return False
        if history.last_flip_at is not None:
            since = now - history.last_flip_at
            if since < self.min_interval_s:
                return False
            opposite = history.last_direction is not None and history.last_direction != _direction(to_role)
            if opposite and since < self.cooldown_s:
                return False
        return True

    # ------------------------------------------------------------------ prefill

    def select_prefill(
        self,
        uncached: Mapping[str, int],
        slo: SLO,
        instances: Sequence[PDInstance],
        history: FlipHistory,
        now: float,
    ) -> PrefillChoice:
        """Where a prompt prefills; ``uncached``: its uncached token count per instance."""

        def ttft(i: PDInstance) -> float:
            return i.predict_ttft(uncached.get(i.name, 0))

        for pool in (POOL_P, POOL_D2P):
            members = sorted((i for i in instances if i.pool == pool), key=lambda i: (i.queue_s, i.name))
            if members and ttft(members[0]) <= self.headroom * slo.ttft_s:
                return PrefillChoice(members[0].name, ttft(members[0]))
        prefill_side = [i for i in instances if i.role == PREFILL]
        best = min(prefill_side, key=lambda i: (ttft(i), i.name), default=None)
        if best is not None and ttft(best) <= slo.ttft_s:  # a less-queued one misses (e.g. no cache hit)
            return PrefillChoice(best.name, ttft(best))
        flip_to = self._flip_to_prefill(instances, slo, history, now)
        if flip_to is not None and (best is None or ttft(flip_to) < ttft(best)):
            predicted = ttft(flip_to)
            reason = (
                f"TTFT predicted {_ms(ttft(best))} on {best.name} > SLO {_ms(slo.ttft_s)}"
                if best is not None
                else "no prefill-capable instance"
            )
            return PrefillChoice(
                flip_to.name, predicted, Flip(flip_to.name, PREFILL, reason), predicted <= slo.ttft_s
            )
        if best is None:
            return PrefillChoice(None, meets_slo=False)
        return PrefillChoice(best.name, ttft(best), meets_slo=ttft(best) <= slo.ttft_s)

    def _flip_to_prefill(
        self, instances: Sequence[PDInstance], slo: SLO, history: FlipHistory, now: float
    ) -> PDInstance | None:
        """The decode-side instance to lend to prefill, if the decode side can spare one."""
        decode_side = [i for i in instances if i.role == DECODE]
        if len(decode_side) - 1 < self.min_decode:
            return None
        # the decode side must spare it: its streams' tokens, served by one fewer instance, stay out
        # of pressure (a TPOT miss slows every stream there; a TTFT miss, one request)
        if steady_step(decode_side, len(decode_side) - 1) > self.pressure * slo.tpot_s:
            return None
        candidates = [i for i in decode_side if self.may_flip(i, PREFILL, history, now)]
        # the P→D pool goes home first, then the lightest (fewest tokens being processed)
        return min(
            candidates,
            key=lambda i: (i.pool != POOL_P2D, i.decode_tokens, i.num_decoding, i.name),
            default=None,
        )

    # ------------------------------------------------------------------ decode

    def select_decode(
        self,
        prefill_name: str | None,
        context_tokens: int,
        slo: SLO,
        instances: Sequence[PDInstance],
        reserve_tokens: int | None = None,
    ) -> DecodeChoice:
        """Where a prefilled request decodes (``context_tokens``: its prompt plus first token;
        ``reserve_tokens``: the KV it may grow to, prompt plus ``max_tokens``; default its context)."""
        reserve = max(context_tokens, reserve_tokens or 0)
        by_name = {i.name: i for i in instances}
        own = by_name.get(prefill_name) if prefill_name is not None else None
        if own is not None and own.num_prefilling == 0:
            # it keeps prefilling: its decode steps will carry prompts like this one
            step = own.predict_step(1, context_tokens, prefill_tokens=context_tokens)
            # what its streams see now overrides the model: a prediction under the SLO while the
            # observed step is over it (a noisy fit, a busy host) does not keep one more there
            observed = own.observed_step_s if own.num_decoding else None
            if own.fits(reserve) and step <= slo.tpot_s and (observed is None or observed <= slo.tpot_s):
                return DecodeChoice(own.name, "prefill instance keeps it (no KV transfer)", step)
        decode_side = sorted(
            (i for i in instances if i.role == DECODE),
            key=lambda i: (i.decode_tokens, i.num_decoding, i.name),
        )
        for inst in decode_side:
            step = inst.predict_step(1, context_tokens)
            if inst.fits(reserve) and step <= slo.tpot_s:
                return DecodeChoice(inst.name, "fewest running tokens within capacity and TPOT SLO", step)
        if decode_side:
            inst = decode_side[0]
            return DecodeChoice(
                inst.name,
                "fewest running tokens (SLO not predicted to hold)",
                inst.predict_step(1, context_tokens),
            )
        if own is not None:
            return DecodeChoice(own.name, "no decode instance", own.predict_step(1, context_tokens))
        return DecodeChoice(None, "no instance")

    # ------------------------------------------------------------------ periodic flips

    def plan_flips(
        self, slo: SLO, instances: Sequence[PDInstance], history: FlipHistory, now: float
    ) -> list[Flip]:
        """Flips to make now from what the monitor observed (at most ``max_flips``, one direction;
        see the module doc)."""
        decode_side = [i for i in instances if i.role == DECODE]
        prefill_side = [i for i in instances if i.role == PREFILL]
        missing = [
            i for i in decode_side if i.busy_since is not None and now - i.busy_since >= self.sustain_s
        ]
        limit = min(self.max_flips(len(instances)), len(prefill_side) - self.min_prefill)
        if limit < 1:
            return self._plan_backlog(slo, prefill_side, decode_side, missing, history, now)
        # decode under pressure: some decode-side batch already takes a good share of the TPOT SLO
        # (an idle prefill side alone is no reason to flip when decode copes)
        decode_busy = any(self._under_pressure(i, slo) for i in decode_side)
        idle = [
            i
            for i in prefill_side
            if i.prefill_utilization <= self.idle_utilization and i.num_prefilling == 0
        ]
        committed = sum(i.committed_tokens for i in decode_side)
        capacity = sum(min(i.capacity_tokens, 1 << 40) for i in decode_side)
        full = bool(decode_side) and committed >= self.capacity_pressure * capacity
        # the prefill instances that can go without the rest missing the TTFT SLO: none queued there,
        # the others' queues well within it, and the prefill side's busy time fits one fewer instance
        absorbs = sum(i.prefill_utilization for i in prefill_side) <= SPARE_UTILIZATION * (
            len(prefill_side) - 1
        )
        spare = [
            i
            for i in prefill_side
            if absorbs
            and i.num_prefilling == 0
            and max((o.queue_s for o in prefill_side if o is not i), default=0.0) <= 0.5 * slo.ttft_s
        ]
        triggers: list[tuple[list[PDInstance], Callable[[PDInstance], str]]] = []
        if missing:
            worst = max(missing, key=lambda i: (i.observed_step_s or 0.0, i.name))
            miss = (
                f"TPOT {_ms(worst.observed_step_s or 0.0)} on {worst.name} > SLO {_ms(slo.tpot_s)} "
                f"for {now - (worst.busy_since or now):.1f}s"
            )
            triggers.append((prefill_side, lambda _i: miss))
        if idle and decode_busy:
            triggers.append(
                (
                    idle,
                    lambda i: (
                        f"{i.name} prefill busy {i.prefill_utilization:.0%} of the last "
                        f"{self.idle_s:.0f}s while decode is busy"
                    ),
                )
            )
        if full and spare:
            triggers.append(
                (
                    spare,
                    lambda _i: (
                        f"decode KV {committed / capacity:.0%} committed ({committed}/{capacity} tokens)"
                    ),
                )
            )
        for candidates, reason in triggers:
            allowed = [i for i in candidates if self.may_flip(i, DECODE, history, now)]
            if allowed:
                picks = sorted(
                    allowed,
                    key=lambda i: (
                        i.pool != POOL_D2P,
                        i.num_prefilling,
                        i.queue_s,
                        i.prefill_utilization,
                        i.name,
                    ),
                )[:limit]
                return [Flip(i.name, DECODE, reason(i)) for i in picks]
        return self._plan_backlog(slo, prefill_side, decode_side, missing, history, now)

    def max_flips(self, num_instances: int) -> int:
        """Flips one plan may make: ``flip_share`` of the instances, at least one."""
        return max(1, int(self.flip_share * num_instances))

    def _plan_backlog(
        self,
        slo: SLO,
        prefill_side: Sequence[PDInstance],
        decode_side: Sequence[PDInstance],
        missing: Sequence[PDInstance],
        history: FlipHistory,
        now: float,
    ) -> list[Flip]:
        """D→P flips for a prefill backlog: the prefill side queued ``backlog`` of the TTFT SLO on average
        while the decode side copes (no TPOT miss, no batch under pressure) and would without the lent
        instances: its KV within ``capacity_pressure`` of what is left, its batch spread over the rest
        predicted under ``pressure`` of the TPOT SLO."""
        if not prefill_side or missing or any(self._under_pressure(i, slo) for i in decode_side):
            return []
        mean = sum(i.queue_s for i in prefill_side) / len(prefill_side)
        if mean < self.backlog * slo.ttft_s:
            return []
        limit = min(self.max_flips(len(prefill_side) + len(decode_side)), len(decode_side) - self.min_decode)
        candidates = sorted(
            (i for i in decode_side if self.may_flip(i, PREFILL, history, now)),
            key=lambda i: (i.pool != POOL_P2D, i.decode_tokens, i.num_decoding, i.name),
        )
        committed = sum(i.committed_tokens for i in decode_side)
        capacity = sum(min(i.capacity_tokens, 1 << 40) for i in decode_side)
        flips: list[Flip] = []
        for inst in candidates[: max(0, limit)]:
            capacity -= min(inst.capacity_tokens, 1 << 40)
            if committed > self.capacity_pressure * capacity:
                break
            # the decode side's token rate, served by the instances left, stays out of pressure
            if steady_step(decode_side, len(decode_side) - len(flips) - 1) > self.pressure * slo.tpot_s:
                break
            flips.append(Flip(inst.name, PREFILL, f"prefill queued {_ms(mean)} on average"))
        return flips

    def _under_pressure(self, inst: PDInstance, slo: SLO) -> bool:
        """A decode batch at ``pressure`` of the TPOT SLO because of its load (more decode instances would
        shorten it), not because of its device's floor: its step predicted for one sequence of its mean
        context times ``load_factor`` stays under what it observes."""
        observed = inst.observed_step_s or 0.0
        if inst.num_decoding == 0 or observed < self.pressure * slo.tpot_s:
            return False
        if inst.tpot is None or not inst.tpot.ready:
            return True
        floor = inst.tpot.predict(1, inst.decode_tokens // inst.num_decoding)
        return observed >= self.load_factor * floor


def steady_step(decode_side: Sequence[PDInstance], left: int) -> float:
    """The decode step ``left`` instances settle at serving the tokens per second ``decode_side``
    produces now (each its batch over its step), spread evenly: the fixed point of step = f(batch),
    batch = rate × step (Little's law) with f the TPOT predictor scaled by what the streams observe
    against it (``_calibration``); inf where none exists (more than ``left`` can serve). 0 without a
    predictor or a decoding sequence."""
    running = [i for i in decode_side if i.num_decoding]
    model = next((i.tpot for i in running if i.tpot is not None), None)
    if not running or model is None:
        return 0.0
    if left < 1:
        return math.inf
    rate = sum(i.num_decoding / max(i.observed_step_s or i.predict_step(), 1e-3) for i in running) / left
    context = sum(i.decode_tokens for i in running) / sum(i.num_decoding for i in running)
    scale = _calibration(running)
    step = scale * model.predict(1, context)
    for _ in range(50):
        batch = max(1.0, rate * step)
        nxt = scale * model.predict(batch, batch * context)  # a mean batch: fractional
        if nxt > 60.0:
            return math.inf
        if abs(nxt - step) < 1e-4:
            return nxt
        step = nxt
    return step


def _calibration(running: Sequence[PDInstance]) -> float:
    """What the decode side's streams observe per token over what the predictor gives their batches now
    (1 where nothing is observed yet): the hand-off, KV imports and a busy host the step model does not
    see, carried over to the batches ``steady_step`` predicts. Bounded to [0.5, 4] against a noisy EWMA."""
    seen = [(i.observed_step_s, i.predict_step()) for i in running if i.observed_step_s]
    predicted = sum(p for _, p in seen)
    if not seen or predicted <= 0.0:
        return 1.0
    return min(4.0, max(0.5, sum(o for o, _ in seen) / predicted))


def _direction(to_role: str) -> str:
    return "D→P" if to_role == PREFILL else "P→D"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms"
