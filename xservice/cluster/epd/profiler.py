"""``xllm profile epd``, the measuring part: drive the engine-side probe, fit, search, choose (torch-free).

The probe (``python -m xengine.tools.profile_epd``) is a child process holding the model, loaded
once; this side asks it for timings over JSON lines, so the binary search and the strategy choice are
the pure policy's own code (``xservice/policies/epd/``), run here over **measured** steps:

1. stage costs: the vision encoder over batches of 1..k images of the workload's size, prefill steps
   of several prompt lengths, decode steps at several batch sizes and contexts; fitted;
2. ``choose_strategy`` on the fitted costs: every strategy and split, its predicted goodput; when the
   chosen deployment decodes in larger batches than were measured, that batch is measured too and the
   costs refitted and the choice made again (once);
3. Algorithm 1's budgets at the chosen deployment's decode batch (or ``decode_batch``), by binary
   search over real steps: B decodes + k image encodes, B decodes + a t-token prefill chunk
   (t in multiples of ``TOKEN_GRANULARITY``). Printed as the engine config fields to set.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from xservice.engine.process import child_env
from xservice.policies.epd import (
    EPDSLO,
    STRATEGIES,
    Budgets,
    EPDWorkload,
    StageCosts,
    budgets,
    choose_strategy,
    evaluate,
    fit_stage_costs,
)

TOKEN_GRANULARITY = 16  # τ_t is searched in multiples of this many prefill tokens
WORKLOADS: dict[str, dict[str, Any]] = {  # named workload descriptions (``--workload``)
    "image-heavy": {
        "images_per_request": 4,
        "image_size": (448, 448),
        "prompt_tokens": 32,
        "output_tokens": 16,
    },
    "text-heavy": {
        "images_per_request": 1,
        "image_size": (224, 224),
        "prompt_tokens": 512,
        "output_tokens": 256,
    },
}


class ProbeError(RuntimeError):
    """The probe process failed (message holds its error or the tail of its stderr)."""


class StageProbe:
    """The engine-side probe process: one model, loaded once; ``call`` one timing request."""

    def __init__(self, model: str, image_size: tuple[int, int], threads: int | None) -> None:
        self._err = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "xengine.tools.profile_epd", "--model", model]
        cmd += ["--image-size", f"{image_size[0]}x{image_size[1]}"]
        cmd += ["--threads", str(threads)] if threads else []
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=child_env()
        )
        self._read()  # "ready", or the load error

    def call(self, op: str, **kw: Any) -> Any:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _read reports why
        return self._read()

    def _read(self) -> Any:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._err.seek(0)
            tail = self._err.read()[-2000:].strip()
            raise ProbeError(f"the profiling process exited ({self._proc.returncode}): {tail}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise ProbeError(answer["error"])
        return answer["result"]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.call("quit")
            except (ProbeError, OSError, ValueError):
                pass
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._err.close()


@dataclass(frozen=True)
class ProfileRequest:
    model: str
    images_per_request: int
    image_size: tuple[int, int]
    prompt_tokens: int
    output_tokens: int
    slo: EPDSLO
    num_instances: int
    request_rate: float | None = None
    threads: int | None = None
    repeats: int = 3
    decode_batch: int | None = None  # budgets at this many decodes; default: the chosen deployment's
    max_encode_images: int = 32  # search ranges of the budgets
    max_prefill_tokens: int = 4096
    max_batch: int = 16  # decode batches measured: 1, 4, ... up to this
    max_images: int = 8  # encode batches measured: 1, 2, 4, ... up to this
    transfer_bytes_per_s: float | None = None  # default: measured over loopback TCP
    cores: float | None = None  # the instances share this many cores (None: one core each)
    strategies: tuple[str, ...] = tuple(STRATEGIES)  # the candidates ranked (policy names: EPD is colocated)


def run_profile(req: ProfileRequest, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Measure, fit, choose, search; the report as a JSON-able dict."""
    progress("loading the model")
    probe = StageProbe(req.model, req.image_size, req.threads)
    try:
        return _profile(probe, req, progress)
    finally:
        probe.close()


def _profile(probe: StageProbe, req: ProfileRequest, progress: Callable[[str], None]) -> dict[str, Any]:
    info = probe.call("info")
    r = req.repeats
    workload = EPDWorkload(
        req.images_per_request, info["image_tokens_per_image"], info["patches_per_image"],
        req.prompt_tokens, req.output_tokens, req.request_rate,
    )  # fmt: skip
    limit = info["max_model_len"] - 2
    encode_samples = []
    for k in _doublings(req.max_images):
        progress(f"encode: {k} image(s) of {req.image_size[0]}x{req.image_size[1]}")
        encode_samples.append((k, k * workload.patches_per_image, probe.call("encode", images=k, repeats=r)))
    prefill_samples = []
    for t in sorted({64, 256, 1024, workload.prompt_len} & set(range(1, limit // 2))):
        progress(f"prefill: {t} tokens")
        prefill_samples.append((t, probe.call("prefill", tokens=t, repeats=r)))
    decode_samples = []
    contexts = sorted(
        {min(workload.prompt_len, limit // 2), min(workload.prompt_len + workload.output_tokens, limit // 2)}
    )
    for b in _doublings(req.max_batch, 4):
        for c in contexts:
            progress(f"decode: {b} sequence(s) on {c}-token contexts")
            decode_samples.append((b, b * c, probe.call("decode", batch=b, context=c, repeats=r)))
    if req.transfer_bytes_per_s is None:
        progress("transfer: loopback TCP bandwidth")
    bandwidth = req.transfer_bytes_per_s or probe.call("bandwidth")
    transfer = {
        "embed_bytes_per_token": float(info["embed_bytes_per_token"]),
        "kv_bytes_per_token": float(info["kv_bytes_per_token"]),
        "transfer_bytes_per_s": float(bandwidth),
    }
    costs = fit_stage_costs(
        [(p, s) for _, p, s in encode_samples], prefill_samples, decode_samples, **transfer
    )
    choice = choose_strategy(costs, workload, req.num_instances, req.slo, req.strategies, req.cores)
    batch, context = _operating_point(req, costs, workload, choice.best, limit, info)
    if batch > max(b for b, _, _ in decode_samples):  # past the measured batches: measure it, refit, once
        progress(f"decode: {batch} sequences on {context}-token contexts (the chosen operating point)")
        decode_samples.append(
            (batch, batch * context, probe.call("decode", batch=batch, context=context, repeats=r))
        )
        costs = fit_stage_costs(
            [(p, s) for _, p, s in encode_samples], prefill_samples, decode_samples, **transfer
        )
        choice = choose_strategy(costs, workload, req.num_instances, req.slo, req.strategies, req.cores)
        batch, context = _operating_point(req, costs, workload, choice.best, limit, info)
    probes = [0]

    def measured(op: str, **kw: Any) -> float:
        probes[0] += 1
        progress(f"budgets (B={batch}): step with {kw}")
        return probe.call(op, batch=batch, context=context, repeats=r, **kw)

    def encode_step(k: int) -> float:
        return measured("step_encode", images=k) if k else measured("decode")

    def prefill_step(t: int) -> float:
        return measured("step_prefill", tokens=t) if t else measured("decode")

    max_tokens = max(0, min(req.max_prefill_tokens, limit - context - 4))
    found = budgets(
        None, req.slo.tpot_s, batch, encode_step=encode_step, prefill_step=prefill_step,
        max_images=req.max_encode_images, max_tokens=max_tokens, token_granularity=TOKEN_GRANULARITY,
    )  # fmt: skip
    model = budgets(
        costs, req.slo.tpot_s, batch, context_tokens=batch * context, patches_per_image=workload.patches_per_image,
        max_images=req.max_encode_images, max_tokens=max_tokens, token_granularity=TOKEN_GRANULARITY,
    )  # fmt: skip
    return {
        "machine": info,
        "workload": {
            **asdict(workload),
            "image_size": list(req.image_size),
            "prompt_len": workload.prompt_len,
        },
        "slo": {"ttft_ms": req.slo.ttft_s * 1e3, "tpot_ms": req.slo.tpot_s * 1e3},
        "instances": req.num_instances,
        "cores": req.cores,
        "repeats": r,
        "samples": {
            "encode": [{"images": k, "patches": p, "s": s} for k, p, s in encode_samples],
            "prefill": [{"tokens": t, "s": s} for t, s in prefill_samples],
            "decode": [{"batch": b, "context_tokens": c, "s": s} for b, c, s in decode_samples],
            "transfer_bytes_per_s": bandwidth,
        },
        "costs": costs.state(),
        "budgets": {
            "decode_batch": batch,
            "context_tokens_per_seq": context,
            "token_granularity": TOKEN_GRANULARITY,
            "measured": _budget_state(found, workload),
            "model": _budget_state(model, workload),
        },
        "strategies": [row.state() for row in choice.table],
        "choice": choice.best.state(),
    }


def _operating_point(
    req: ProfileRequest, costs: StageCosts, workload: EPDWorkload, best: Any, limit: int, info: dict[str, Any]
) -> tuple[int, int]:
    """(decode batch, context per decode) the budgets are searched at: ``decode_batch`` if given, else
    the decode batch the chosen deployment runs at its goodput (at least 1, at most what the probe
    engine holds)."""
    context = min(round(workload.mean_context), limit // 2)
    if req.decode_batch is not None:
        return req.decode_batch, context
    batch = 1
    if best.goodput > 0:
        counts = tuple(c for _, c in best.counts)
        e = evaluate(best.strategy, counts, costs, workload, req.slo, best.goodput, req.cores)
        d_pool = next(k for k in STRATEGIES[best.strategy] if "D" in k)
        if d_pool in e.budgets:
            batch = max(1, e.budgets[d_pool].decode_batch)
    return min(batch, probe_capacity(info, context)), context


def probe_capacity(info: dict[str, Any], context: int) -> int:
    """The most decodes the probe engine can step beside one more (prefilling or encoding) request:
    its ``max_num_seqs`` and KV cache, each sequence holding ``context`` tokens plus its next block."""
    seqs = int(info.get("max_num_seqs", 256)) - 1
    kv_tokens = info.get("kv_cache_tokens")
    if kv_tokens:
        seqs = min(seqs, int(kv_tokens) // (context + 64) - 1)
    return max(1, seqs)


def _budget_state(b: Budgets, w: EPDWorkload) -> dict[str, Any]:
    """τ_e, τ_t and the engine config fields to set (each at least 1: the engine's minimum)."""
    return {
        "feasible": b.feasible,
        "tau_e": b.max_encode_images,
        "tau_t": b.max_num_batched_tokens,
        "decode_only_s": b.decode_only_s,
        "config": {
            "scheduler.max_encode_images": max(1, b.max_encode_images),
            "scheduler.max_encode_tokens": max(1, b.max_encode_images) * max(1, w.image_tokens_per_image),
            "scheduler.max_num_batched_tokens": max(1, b.max_num_batched_tokens),
        },
        "probes": [{"kind": kind, "x": x, "s": s} for kind, x, s in b.probes],
    }


def _doublings(top: int, factor: int = 2) -> list[int]:
    out, x = [], 1
    while x < top:
        out.append(x)
        x *= factor
    return out + [top]
