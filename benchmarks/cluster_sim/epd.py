"""EPD (encode / prefill / decode) deployments of a multimodal workload in the simulator, placed by the
service's own EPD policies, unchanged, and held against the analytical model that chooses them.

Instances run HydraInfer-style stage-level steps over ``StageCosts`` (what ``xllm profile epd``
measures): a step carries the instance's decodes, up to τ_e images to encode and a prefill chunk up to
τ_t tokens minus the decodes, and takes ``StageCosts.step_s`` of that. The budgets are the service's:
Algorithm 1's τ_e / τ_t (``budgets``) at the deployment's decode batch, on the instances whose steps
carry decodes, the others at the engine's defaults (``xservice/policies/epd/assign.py``);
``--budgets all`` puts them on every instance that encodes / prefills (the service's plan before the
simulator showed what that costs). A request's images go to the encode-capable
instance ``select_by_images`` picks (by load: the simulator keeps no image cache), its embeddings to
the prefill-capable one it picks (the encoder itself where it prefills: it holds them), its KV to the
least-loaded decode-capable instance (the prefill instance where it decodes); embeddings and KV take
``StageCosts.transfer_time_s`` of their bytes.

    PYTHONPATH=. .venv/bin/python -m benchmarks.cluster_sim.epd --instances 8 --workload image-heavy

runs every strategy at its best split (``choose_strategy``'s table) over a Poisson trace at a share of
the chosen deployment's predicted goodput, and prints, per strategy, the model's prediction
(``evaluate``: TTFT, TPOT, whether the SLOs hold) beside the simulated TTFT / TPOT percentiles and SLO
attainment. ``--costs REPORT.json`` takes the costs from an ``xllm profile epd`` report.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.smoke import add_smoke_flag, parse_args
from ops.platforms.cpu_features import cpu_features
from xservice.policies.epd import (
    EPDSLO,
    STRATEGIES,
    EPDWorkload,
    StageCosts,
    budgets,
    choose_strategy,
    evaluate,
)
from xservice.policies.epd.placement import select_by_images
from xservice.policies.routing import InstanceSnapshot

# a GPU-like instance (illustrative, not measured): encode batching pays, decode steps are cheap per sequence
ILLUSTRATIVE = StageCosts(
    encode_s=0.02, encode_s_per_patch=2e-5,
    prefill_s=0.01, prefill_s_per_token=4e-5, prefill_s_per_token2=1e-9,
    decode_s=0.015, decode_s_per_seq=1e-4, decode_s_per_context_token=2e-7,
    embed_bytes_per_token=7168, kv_bytes_per_token=57344, transfer_bytes_per_s=5e9, transfer_s=0.001,
)  # fmt: skip
WORKLOADS = {
    "image-heavy": EPDWorkload(4, 256, 1024, 64, 16),
    "text-heavy": EPDWorkload(1, 64, 256, 512, 256),
}
DEFAULT_TOKEN_BUDGET = 2048  # where τ_t is 0 (kept as configured, as the service does)
DEFAULT_ENCODE_IMAGES = 4  # scheduler.max_encode_images's default
_ARRIVE, _STEP, _ENCODED, _PREFILL, _DECODE = range(5)


@dataclass
class _Req:
    rid: int
    arrival: float
    images: int
    prompt: int  # text + image tokens
    output: int
    first_token: float | None = None
    end: float | None = None


@dataclass
class EPDInstance:
    index: int
    kind: str  # E, P, D, EP, ED or EPD
    max_images: int  # τ_e
    token_budget: int  # τ_t
    encode_q: deque = field(default_factory=deque)  # [request, images left]
    prefill_q: deque = field(default_factory=deque)  # [request, tokens left]
    ends: list = field(default_factory=list)  # (last step, request id)
    num_decoding: int = 0
    ctx_sum: int = 0
    steps: int = 0
    busy: bool = False
    inflight: int = 0
    step: tuple | None = None  # (decodes, encodes [(entry, images)], chunks [(entry, tokens)])

    @property
    def name(self) -> str:
        return f"{self.kind.lower()}{self.index}"

    def has_work(self) -> bool:
        return bool(self.num_decoding or self.encode_q or self.prefill_q)


class EPDCluster:
    """One deployment: ``counts`` instances per pool of ``strategy`` (``STRATEGIES``)."""

    def __init__(
        self,
        strategy: str,
        counts: tuple[int, ...],
        costs: StageCosts,
        workload: EPDWorkload,
        slo: EPDSLO,
        decode_batch: int,
        budgets_on: str = "decode",
    ) -> None:
        self.costs, self.workload, self.slo = costs, workload, slo
        b = budgets(
            costs,
            slo.tpot_s,
            max(1, decode_batch),
            context_tokens=max(1, decode_batch) * workload.mean_context,
            patches_per_image=workload.patches_per_image,
        )
        self.tau_e = max(1, b.max_encode_images)  # an engine encodes at least one image a step
        self.tau_t = b.max_num_batched_tokens if b.max_num_batched_tokens > 0 else DEFAULT_TOKEN_BUDGET
        kinds = [k for kind, n in zip(STRATEGIES[strategy], counts) for k in [kind] * n]
        if budgets_on == "all":  # every encoder / prefiller
            self.instances = [EPDInstance(i, k, self.tau_e, self.tau_t) for i, k in enumerate(kinds)]
        elif budgets_on == "decode":  # the service's plan_deployment: where they protect a TPOT
            self.instances = [
                EPDInstance(i, k, self.tau_e, self.tau_t)
                if "D" in k
                else EPDInstance(i, k, DEFAULT_ENCODE_IMAGES, DEFAULT_TOKEN_BUDGET)
                for i, k in enumerate(kinds)
            ]
        else:
            raise ValueError(f"budgets_on must be 'all' or 'decode', got {budgets_on!r}")
        self.events: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.requests: dict[int, _Req] = {}
        self.decode_on: dict[int, EPDInstance] = {}

    # ------------------------------------------------------------------ the loop
    def run(self, arrivals: list[float]) -> dict[int, _Req]:
        w = self.workload
        for rid, t in enumerate(arrivals):
            self.requests[rid] = _Req(rid, t, w.images_per_request, w.prompt_len, w.output_tokens)
            self._push(t, _ARRIVE, rid)
        while self.events:
            self.now, _, kind, a, b = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self._arrive(self.requests[a])
            elif kind == _STEP:
                self._step_done(self.instances[a])
            elif kind == _ENCODED:  # embeddings arrived at prefill instance a
                self._enqueue_prefill(self.instances[a], self.requests[b])
            elif kind == _PREFILL:
                self._enqueue_prefill(self.instances[a], self.requests[b])
            else:  # KV arrived at decode instance a
                self._join(self.instances[a], self.requests[b])
        return self.requests

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, a, b))

    def _kick(self, inst: EPDInstance) -> None:
        if not inst.busy and inst.has_work():
            self._push(self.now + self._start(inst), _STEP, inst.index)

    # ------------------------------------------------------------------ placement (the service's)
    def _pick(self, stage: str, held: dict[str, int] | None = None, images: int = 0) -> EPDInstance:
        able = [i for i in self.instances if stage in i.kind]
        shown = [InstanceSnapshot(i.name, num_inflight=i.inflight) for i in able]
        choice = select_by_images(shown, held or {}, images)
        assert choice is not None
        return next(i for i in able if i.name == choice.name)

    def _arrive(self, req: _Req) -> None:
        if req.images:
            inst = self._pick("E", images=req.images)
            inst.inflight += 1
            inst.encode_q.append([req, req.images])
            self._kick(inst)
        else:
            self._to_prefill(req, None)

    def _to_prefill(self, req: _Req, encoder: EPDInstance | None) -> None:
        held = {encoder.name: req.images} if encoder is not None and "P" in encoder.kind else {}
        inst = self._pick("P", held, req.images)
        inst.inflight += 1
        if encoder is None or inst is encoder:
            self._enqueue_prefill(inst, req)
        else:
            c = self.costs
            delay = c.transfer_time_s(
                req.images * self.workload.image_tokens_per_image * c.embed_bytes_per_token
            )
            self._push(self.now + delay, _ENCODED, inst.index, req.rid)

    def _enqueue_prefill(self, inst: EPDInstance, req: _Req) -> None:
        inst.prefill_q.append([req, req.prompt])
        self._kick(inst)

    def _to_decode(self, req: _Req, prefill: EPDInstance) -> None:
        if "D" in prefill.kind:
            inst = prefill
        else:
            able = [i for i in self.instances if "D" in i.kind]
            inst = min(able, key=lambda i: (i.inflight, i.name))
        inst.inflight += 1
        if inst is prefill:
            self._join(inst, req)
        else:
            delay = self.costs.transfer_time_s(req.prompt * self.costs.kv_bytes_per_token)
            self._push(self.now + delay, _DECODE, inst.index, req.rid)

    def _join(self, inst: EPDInstance, req: _Req) -> None:
        if req.output > 1:
            heapq.heappush(inst.ends, (inst.steps + req.output - 1 + inst.busy, req.rid))
            inst.num_decoding += 1
            inst.ctx_sum += req.prompt + 1
            self.decode_on[req.rid] = inst
        else:
            req.end = req.first_token
            inst.inflight -= 1
        self._kick(inst)

    # ------------------------------------------------------------------ steps
    def _start(self, inst: EPDInstance) -> float:
        """The engine's stage scheduling: the decodes, then prefill chunks up to the token budget; a step
        with no chunk encodes up to τ_e images instead (``xengine/multimodal/encode_stage.py``)."""
        chunks, room = [], inst.token_budget - inst.num_decoding
        for entry in inst.prefill_q:
            if room <= 0:
                break
            k = min(entry[1], room)
            chunks.append((entry, k))
            room -= k
        encodes, images = [], 0
        if not chunks:
            for entry in inst.encode_q:
                if images >= inst.max_images:
                    break
                k = min(entry[1], inst.max_images - images)
                encodes.append((entry, k))
                images += k
        inst.step = (inst.num_decoding, encodes, chunks)
        inst.busy = True
        return self.costs.step_s(
            inst.num_decoding,
            inst.ctx_sum,
            prefill_tokens=sum(k for _, k in chunks),
            encode_patches=images * self.workload.patches_per_image,
        )

    def _step_done(self, inst: EPDInstance) -> None:
        assert inst.step is not None
        decodes, encodes, chunks = inst.step
        inst.step, inst.busy = None, False
        inst.steps += 1
        inst.ctx_sum += decodes
        while inst.ends and inst.ends[0][0] <= inst.steps:
            _, rid = heapq.heappop(inst.ends)
            req = self.requests[rid]
            req.end = self.now
            inst.num_decoding -= 1
            inst.ctx_sum -= req.prompt + req.output
            inst.inflight -= 1
        for entry, k in encodes:
            entry[1] -= k
            if entry[1] == 0:
                inst.encode_q.remove(entry)
                inst.inflight -= 1
                self._to_prefill(entry[0], inst)
        for entry, k in chunks:
            entry[1] -= k
            if entry[1] == 0:
                inst.prefill_q.remove(entry)
                inst.inflight -= 1
                entry[0].first_token = self.now
                self._to_decode(entry[0], inst)
        self._kick(inst)


def simulate(
    strategy: str,
    counts: tuple[int, ...],
    costs: StageCosts,
    workload: EPDWorkload,
    slo: EPDSLO,
    rate: float,
    num_requests: int,
    seed: int = 0,
    budgets_on: str = "decode",
) -> dict:
    """Simulated TTFT / TPOT percentiles and SLO attainment of one deployment at ``rate``, beside the
    model's prediction (``evaluate``) for it."""
    predicted = evaluate(strategy, counts, costs, workload, slo, rate)
    d_kind = next(k for k in STRATEGIES[strategy] if "D" in k)
    d_count = counts[STRATEGIES[strategy].index(d_kind)]
    # the decode batch the budgets are sized for: Little's law at the predicted step (as the profiler)
    step = predicted.tpot_s if math.isfinite(predicted.tpot_s) else slo.tpot_s
    batch = max(1, round(rate / d_count * (workload.output_tokens - 1) * step))
    cluster = EPDCluster(strategy, counts, costs, workload, slo, batch, budgets_on)
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, num_requests))
    reqs = list(cluster.run([float(t) for t in arrivals]).values())
    ttft = np.array([r.first_token - r.arrival for r in reqs])
    tpot = np.array([(r.end - r.first_token) / (r.output - 1) for r in reqs if r.output > 1])
    met = [
        r.first_token - r.arrival <= slo.ttft_s
        and (r.output <= 1 or (r.end - r.first_token) / (r.output - 1) <= slo.tpot_s)
        for r in reqs
    ]
    span = max(r.end for r in reqs) - min(r.arrival for r in reqs)

    def pct(x: np.ndarray) -> dict[str, float]:
        p50, p90 = np.percentile(x, [50, 90]) if len(x) else (0.0, 0.0)
        return {"p50": round(float(p50), 4), "p90": round(float(p90), 4)}

    return {
        "strategy": strategy,
        "counts": dict(zip(STRATEGIES[strategy], counts)),
        "rate": round(rate, 3),
        "budgets": {"tau_e": cluster.tau_e, "tau_t": cluster.tau_t, "decode_batch": batch},
        "predicted": {
            "meets_slos": predicted.ok,
            "ttft_s": round(predicted.ttft_s, 4) if math.isfinite(predicted.ttft_s) else None,
            "tpot_s": round(predicted.tpot_s, 4) if math.isfinite(predicted.tpot_s) else None,
            "limit": predicted.limit,
        },
        "simulated": {
            "slo_attainment": round(float(np.mean(met)), 4),
            "goodput": round(sum(met) / span, 3) if span > 0 else 0.0,
            "ttft_s": pct(ttft),
            "tpot_s": pct(tpot),
        },
    }


def costs_from_report(path: str) -> StageCosts:
    """The ``StageCosts`` of an ``xllm profile epd`` report (its ``costs``)."""
    c = json.loads(Path(path).read_text())["costs"]
    t = c["transfer"]
    return StageCosts(
        *c["encode"]["coef"], *c["prefill"]["coef"], *c["decode"]["coef"],
        embed_bytes_per_token=t["embed_bytes_per_token"], kv_bytes_per_token=t["kv_bytes_per_token"],
        transfer_bytes_per_s=t["bytes_per_s"], transfer_s=t["latency_s"], max_num_seqs=c["max_num_seqs"],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="image-heavy")
    ap.add_argument(
        "--costs", metavar="REPORT.json", help="an xllm profile epd report (default: illustrative)"
    )
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--load", type=float, default=0.8, help="rate: this share of the chosen one's goodput")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--budgets",
        choices=["all", "decode"],
        default="decode",
        help="τ_e / τ_t on the instances that decode (the service's plan) or on every one that encodes / prefills",
    )
    add_smoke_flag(ap)
    args = parse_args(ap, argv, {"instances": 4, "requests": 300})
    costs = costs_from_report(args.costs) if args.costs else ILLUSTRATIVE
    workload = WORKLOADS[args.workload]
    slo = EPDSLO(args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
    t0 = time.perf_counter()
    choice = choose_strategy(costs, workload, args.instances, slo)
    rate = args.load * choice.best.goodput
    if not rate > 0:
        raise SystemExit(f"no strategy meets the SLOs on {args.instances} instances: {choice.best.limit}")
    best_split: dict[str, tuple[int, ...]] = {}
    for row in choice.table:  # best first
        best_split.setdefault(row.strategy, tuple(n for _, n in row.counts))
    results = []
    for strategy, counts in best_split.items():
        results.append(
            simulate(strategy, counts, costs, workload, slo, rate, args.requests, args.seed, args.budgets)
        )
        print(
            f"[epd-sim] {strategy} {counts}: {results[-1]['simulated']['slo_attainment']:.3f}",
            file=sys.stderr,
        )
    out = {
        "instances": args.instances,
        "workload": args.workload,
        "costs": "illustrative" if not args.costs else args.costs,
        "slo_ms": {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms},
        "budgets_on": args.budgets,
        "chosen": {
            "strategy": choice.best.strategy,
            "counts": dict(choice.best.counts),
            "goodput": round(choice.best.goodput, 3),
        },
        "rate": round(rate, 3),
        "strategies": results,
        "best_simulated": max(results, key=lambda r: r["simulated"]["slo_attainment"])["strategy"],
        "host_cpu": cpu_features().model_name,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
