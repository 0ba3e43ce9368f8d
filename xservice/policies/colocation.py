"""Online/offline co-location across instances (xLLM report §3.1), pure: no I/O, numpy only.

The cluster is two pools: the **latency-relaxed** pool (the prefill-role instances) runs every
prefill, online and offline, and offline decodes; the **latency-strict** pool (the decode-role
instances) runs online decodes. An offline request's decode may run in either pool: it joins a
strict instance's decode batch only when the performance model predicts that batch's step time
stays under the TPOT SLO (with headroom) with it, and stays on its relaxed (prefill) instance
otherwise, where it costs no KV transfer. Online arrivals on a relaxed instance stop offline
prefill between layers (``xengine/colocation/interrupter.py``).

The performance model is a roofline with online factor learning: an instance's raw step time is
``max(compute / peak FLOP/s, bytes / memory bandwidth)`` over its weights, the batch's tokens and
the KV it attends (``RooflineSpec``), and the step time it reports is fitted as
``a + k · raw`` by least squares over its recent steps (``RooflineModel``), so ``a`` absorbs the
per-step overhead the roofline does not see and ``k`` how far from the roofline it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xservice.policies.predictors import OnlineLeastSquares

CPU_PEAK_FLOPS_PER_THREAD = 80e9  # fp32 matmul on one AVX-512 core (docs/dynamic_pd.md)
CPU_MEM_BW = 15e9  # bytes/s


@dataclass(frozen=True)
class RooflineSpec:
    """What one instance's steps cost on its hardware, before any correction."""

    peak_flops: float  # FLOP/s its matmuls reach
    mem_bw: float  # bytes/s
    weight_bytes: float  # read once per step
    flops_per_token: float  # 2 · parameters
    kv_bytes_per_token: float  # K and V of every layer, per context token attended

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.mem_bw <= 0:
            raise ValueError("peak_flops and mem_bw must be > 0")

    def raw_step_s(self, num_seqs: int, context_tokens: int, prefill_tokens: int = 0) -> float:
        """Roofline time of a step: ``num_seqs`` decoding sequences (one token each) attending
        ``context_tokens`` in all, plus ``prefill_tokens`` prompt tokens."""
        tokens = num_seqs + prefill_tokens
        # attention: each sequence's new token reads its context once (about one FLOP per KV byte)
        attn_flops = self.kv_bytes_per_token * context_tokens if tokens else 0.0
        compute = (tokens * self.flops_per_token + attn_flops) / self.peak_flops
        memory = (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / self.mem_bw
        return max(compute, memory)


class RooflineModel:
    """Step time ``a + k · raw_step_s``, ``(a, k)`` fitted online from the instance's steps."""

    def __init__(self, spec: RooflineSpec, window: int = 256) -> None:
        self.spec = spec
        self._fit = OnlineLeastSquares(2, window, nonnegative=True)
        self.num_observed = 0

    def observe(self, num_seqs: int, context_tokens: int, prefill_tokens: int, step_s: float) -> None:
        raw = self.spec.raw_step_s(num_seqs, context_tokens, prefill_tokens)
        self._fit.add([1.0, raw * 1000], step_s)  # raw in ms: comparable feature scales
        self.num_observed += 1

    @property
    def ready(self) -> bool:
        return self.num_observed >= 4

    def predict(self, num_seqs: int, context_tokens: int, prefill_tokens: int = 0) -> float:
        raw = self.spec.raw_step_s(num_seqs, context_tokens, prefill_tokens)
        if not self.ready:
            return raw  # the bare roofline until the instance reported steps
        a, k = self._fit.coef()
        return max(raw, a + k * raw * 1000)

    def bottleneck(self, num_seqs: int, context_tokens: int) -> str:
        """``compute`` or ``memory``: which bound the raw roofline of such a batch hits."""
        s = self.spec
        compute = (num_seqs * s.flops_per_token + s.kv_bytes_per_token * context_tokens) / s.peak_flops
        memory = (s.weight_bytes + context_tokens * s.kv_bytes_per_token) / s.mem_bw
        return "compute" if compute >= memory else "memory"

    def state(self) -> dict:
        a, k = self._fit.coef()
        return {"overhead_s": round(a, 6), "factor": round(k, 4), "num_observed": self.num_observed}


@dataclass(frozen=True)
class StrictInstance:
    """A latency-strict (decode-role) instance as the policy sees it."""

    name: str
    model: RooflineModel
    num_online: int  # decode streams running there
    num_offline: int
    context_tokens: int  # KV tokens those streams attend
    capacity_tokens: int = 1 << 62
    tpot_slo_s: float | None = None  # the tightest TPOT SLO of its online streams (None: the default)
    offline: tuple[tuple[str, int], ...] = ()  # its offline streams: (request id, context tokens)
    observed_step_s: float | None = None  # recent observed time per token of its streams


@dataclass(frozen=True)
class Eviction:
    """Move offline request ``req_id``'s decode off strict instance ``instance`` (back to the relaxed pool)."""

    req_id: str
    instance: str
    reason: str


@dataclass(frozen=True)
class OfflineDecodeChoice:
    name: str  # where the offline request decodes: a strict instance, or the relaxed one it prefilled on
    strict: bool
    predicted_step_s: float | None  # of the strict batch with it (None: stays relaxed, none fitted)
    reason: str


class ColocationPolicy:
    def __init__(self, tpot_slo_s: float, headroom: float = 0.8, max_offline_per_instance: int = 64) -> None:
        if tpot_slo_s <= 0:
            raise ValueError("tpot_slo_s must be > 0")
        if not 0 < headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        self.tpot_slo_s = tpot_slo_s
        self.headroom = headroom
        self.max_offline = max_offline_per_instance

    def select_offline_decode(
        self, relaxed_name: str, context_tokens: int, strict: Sequence[StrictInstance]
    ) -> OfflineDecodeChoice:
        """Where an offline request that prefilled on ``relaxed_name`` decodes: the strict instance
        whose batch keeps the most slack under ``headroom · SLO`` with it, else ``relaxed_name``."""
        best: tuple[float, StrictInstance, float, float] | None = None
        for inst in strict:
            if inst.num_offline >= self.max_offline:
                continue
            if inst.context_tokens + context_tokens > inst.capacity_tokens:
                continue
            budget = self.headroom * self.slo_of(inst)
            if inst.observed_step_s is not None and inst.observed_step_s > budget:
                continue  # its streams already see it over: eviction would move it right back
            b = inst.num_online + inst.num_offline + 1
            step = inst.model.predict(b, inst.context_tokens + context_tokens)
            slack = budget - step
            if slack >= 0 and (best is None or slack > best[0]):
                best = (slack, inst, step, budget)
        if best is None:
            return OfflineDecodeChoice(
                relaxed_name, False, None, "no strict instance holds the TPOT SLO with it"
            )
        _, inst, step, budget = best
        return OfflineDecodeChoice(
            inst.name, True, step, f"predicted step {step * 1000:.1f} ms <= {budget * 1000:.1f} ms"
        )

    def slo_of(self, inst: StrictInstance) -> float:
        """The TPOT SLO ``inst``'s batch must hold: the default, or a tighter one an online stream asked for."""
        return self.tpot_slo_s if inst.tpot_slo_s is None else min(self.tpot_slo_s, inst.tpot_slo_s)

    def select_evictions(self, strict: Sequence[StrictInstance]) -> list[Eviction]:
        """Offline decodes to move off strict instances whose batch no longer holds its TPOT SLO.

        An instance is over when the model predicts its current batch over the SLO (online load rose,
        or a stream asked for a tighter SLO) or its streams observe it over. Its offline streams leave
        largest context first (they cost the most KV reads per step) until the predicted step is back
        under ``headroom · SLO``; at least one leaves when only the observation says over (the model is
        optimistic there, and the next check sees the result)."""
        out: list[Eviction] = []
        for inst in strict:
            if not inst.offline:
                continue
            slo = self.slo_of(inst)
            batch, context = inst.num_online + len(inst.offline), inst.context_tokens
            predicted = inst.model.predict(batch, context)
            observed = inst.observed_step_s
            if predicted <= slo and (observed is None or observed <= slo):
                continue
            why = (
                f"predicted step {predicted * 1000:.1f} ms"
                if predicted > slo
                else f"observed {observed * 1000:.1f} ms"
            ) + f" > TPOT SLO {slo * 1000:.1f} ms"
            budget = self.headroom * slo
            for i, (req_id, ctx) in enumerate(sorted(inst.offline, key=lambda o: (-o[1], o[0]))):
                if i > 0 and inst.model.predict(batch, context) <= budget:
                    break
                out.append(Eviction(req_id, inst.name, why))
                batch, context = batch - 1, context - ctx
        return out
