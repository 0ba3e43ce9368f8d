"""Engine side of ``xllm profile engine`` (run as ``python -m xengine.tools.profile_engine``: the service's
command stays out of the engine's packages): time a model's engine steps on this machine and fit a device
profile (``ops/platforms/device_profile.py``) that an emulated instance (``--device emulated``) and the
cluster simulator replay.

Probes (the model forward and logits of one engine step, ``StepTiming.forward_s``: what a device does;
median of ``repeats`` after a warm-up, ``profile_epd.StageBench``):

- decode batches of ``B`` sequences on 16-token prompts (``B`` new tokens, ``B`` sequences);
- one prompt of ``T`` tokens prefilled alone;
- one sequence decoding on a ``C``-token context (attention's share).

Fit: ``attention_ns`` is the least-squares slope of the context series against its cached context;
``base_ms`` the one-token step without it; ``tokens_ms`` the remaining time of every other probe at its
token count (non-decreasing). The profile records each probe with its
prediction and the relative error.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch

from ops.platforms.cpu_features import cpu_features
from ops.platforms.device_profile import DeviceProfile
from xengine.tools.profile_epd import StageBench, loopback_bandwidth

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
CONTEXTS = (16, 256, 512, 1024, 2048, 4096)
SHORT = 16  # the decode batches' prompts


def measure(
    model_dir: str,
    num_threads: int | None = 1,
    repeats: int = 3,
    max_tokens: int = 2048,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The probes' samples (``kind``, ``tokens``, ``seqs``, ``pairs``, ``ms``) and the engine's facts."""
    bench = StageBench(model_dir, None, num_threads, timed="forward_s", max_model_len=max_tokens + 128)
    limit = bench.max_model_len - 72  # room to decode after the longest prompt
    samples: list[dict[str, Any]] = []

    def add(kind: str, tokens: int, seqs: int, pairs: int, seconds: float) -> None:
        samples.append({"kind": kind, "tokens": tokens, "seqs": seqs, "pairs": pairs, "ms": seconds * 1000})
        if progress is not None:
            progress(f"{kind:8} tokens {tokens:5} seqs {seqs:3}: {seconds * 1000:8.2f} ms")

    for b in DECODE_BATCHES:  # pairs: each new token against the context cached before the step
        add("decode", b, b, b * SHORT, bench.decode(b, SHORT, repeats))
    for t in (t for t in PREFILL_TOKENS if t <= min(max_tokens, limit)):
        add("prefill", t, 1, 0, bench.prefill(t, repeats))
    for c in (c for c in CONTEXTS if c <= min(max_tokens, limit)):
        add("context", 1, 1, c, bench.decode(1, c, repeats))
    bench.clear()
    e = bench.engine
    facts = {
        "model": e.info.model_name,
        "device": e.info.device if e.info.device != "cpu" else f"cpu: {cpu_features().model_name}",
        "num_threads": torch.get_num_threads(),
        "dtype": str(e.dtype).removeprefix("torch."),
        "kv_bytes_per_token": e.info.kv_bytes_per_token,
        "kv_capacity_tokens": e.info.num_total_blocks * e.info.block_size,
    }
    return samples, facts


def fit(samples: list[dict[str, Any]], name: str) -> DeviceProfile:
    """A profile from ``measure``'s samples; each sample gets its ``predicted_ms`` and ``rel_error``."""
    ctx = [s for s in samples if s["kind"] == "context"]
    attention_ns = 0.0
    if len(ctx) >= 2:
        mx, my = statistics.fmean(s["pairs"] for s in ctx), statistics.fmean(s["ms"] for s in ctx)
        var = sum((s["pairs"] - mx) ** 2 for s in ctx)
        slope_ms = sum((s["pairs"] - mx) * (s["ms"] - my) for s in ctx) / var if var else 0.0
        attention_ns = max(0.0, slope_ms * 1e6)
    one = [s for s in samples if s["tokens"] == 1]
    base_ms = max(0.0, min(s["ms"] - attention_ns * s["pairs"] * 1e-6 for s in one))
    by_tokens: dict[int, list[float]] = {}
    for s in samples:
        if s["kind"] != "context":
            rest = s["ms"] - base_ms - attention_ns * s["pairs"] * 1e-6
            by_tokens.setdefault(s["tokens"], []).append(max(0.0, rest))
    curve, floor = [], 0.0
    for tokens in sorted(by_tokens):
        floor = max(floor, statistics.median(by_tokens[tokens]))  # a step of more tokens never costs less
        curve.append((float(tokens), floor))
    profile = DeviceProfile(name=name, base_ms=base_ms, tokens_ms=curve, attention_ns=attention_ns)
    for s in samples:
        predicted = profile.step_seconds([s["tokens"] // s["seqs"]] * s["seqs"], _contexts(s)) * 1000
        s["predicted_ms"] = predicted
        s["rel_error"] = (predicted - s["ms"]) / s["ms"] if s["ms"] else 0.0
    return profile


def _contexts(sample: dict[str, Any]) -> list[int]:
    """Per sequence of a probe: the context its new tokens end (so that ``q * (s - q)`` sums to its pairs)."""
    q = sample["tokens"] // sample["seqs"]
    return [q + round(sample["pairs"] / sample["seqs"] / q)] * sample["seqs"]


def profile_engine(
    model_dir: str,
    name: str,
    num_threads: int | None = 1,
    repeats: int = 3,
    max_tokens: int = 2048,
    progress: Callable[[str], None] | None = None,
) -> DeviceProfile:
    """Measure ``model_dir`` here and return its fitted profile (its probes and errors in ``measured``)."""
    samples, facts = measure(model_dir, num_threads, repeats, max_tokens, progress)
    if progress is not None:
        progress("loopback bandwidth ...")
    gbps = loopback_bandwidth() * 8 / 1e9
    profile = fit(samples, name)
    errors = sorted(abs(s["rel_error"]) for s in samples)
    threads = facts["num_threads"]
    return dataclasses.replace(
        profile,
        kv_bytes_per_token=int(facts["kv_bytes_per_token"]),
        transfer_gbps=round(gbps, 3),
        kv_capacity_tokens=int(facts["kv_capacity_tokens"]),
        device=f"{facts['device']} ({threads} thread{'s' if threads != 1 else ''})",
        model=str(facts["model"]),
        measured={
            **facts,
            "repeats": repeats,
            "median_abs_rel_error": statistics.median(errors),
            "max_abs_rel_error": errors[-1],
            "samples": samples,
        },
    )


def main(argv: list[str] | None = None) -> int:
    """``--model DIR --name NAME [--num-threads N] [--repeats R] [--max-tokens T] [--out FILE]``: progress
    and the fit's summary on stderr; the profile to ``--out`` or stdout."""
    import argparse
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Measure engine steps here and fit a device profile.")
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    def progress(line: str) -> None:
        print(f"[profile] {line}", file=sys.stderr, flush=True)

    profile = profile_engine(args.model, args.name, args.num_threads, args.repeats, args.max_tokens, progress)
    m = profile.measured
    progress(
        f"fit: base {profile.base_ms:.2f} ms, attention {profile.attention_ns:.3f} ns/pair; "
        f"error median {m['median_abs_rel_error']:.1%}, max {m['max_abs_rel_error']:.1%}"
    )
    if args.out:
        Path(args.out).write_text(profile.to_json())
        progress(f"wrote {args.out}")
    else:
        sys.stdout.write(profile.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
