"""How closely each reduced-precision mode agrees with HF ``transformers`` in float32 on the same weights.

Seeded random token sequences (``--positions`` tokens in all, ``--seq-len`` each) go through every mode
teacher-forced: one full-sequence forward per sequence, logits at every position. Each mode is scored
against HF float32's logits (``benchmarks/accuracy/metrics.py``): next-token argmax agreement, the same
over the positions where HF float32's top-1 leads its top-2 by more than ``--margin`` (near-ties of a
random checkpoint flip on any rounding), and mean / max KL(HF fp32 || mode). Modes
(``benchmarks/accuracy/modes.py``): ``hf_bfloat16`` (HF's own bf16 model, the bar our bf16 must reach),
``xllm_float32`` (our model as the engine loads it: agreement 1 and KL 0 are the sanity check),
``xllm_bfloat16``, ``xllm_w8a8_float32`` and ``xllm_w8a8_bfloat16`` (``--quantization w8a8`` over each dtype);
with ``--more-schemes`` (alias ``--weight-only``) also ``xllm_int8_*``, ``xllm_int4_*`` (weight-only
``--quantization int8`` / ``int4``) and ``xllm_fp8_*`` (``--quantization fp8``: on a CPU its torch reference,
the arithmetic the CUDA kernel is tested against) over each dtype; any mode can be named in ``--modes``.

    PYTHONPATH=. .venv/bin/python -m benchmarks.dtype_accuracy --size small --num-threads 1 --more-schemes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.accuracy.metrics import ModeScore
from benchmarks.accuracy.modes import DEFAULT_MODES, MODES, REFERENCE, LogitsFn, xllm_logits_fn
from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args

SMOKE = dict(positions=64, seq_len=32)
# --more-schemes: our model with weight-only int8 / int4 and with fp8 linear layers, over float32 and bfloat16
WEIGHT_ONLY_MODES: dict[str, Callable[[str], LogitsFn]] = {
    f"xllm_{scheme}_{name}": lambda d, dtype=dtype, scheme=scheme: xllm_logits_fn(d, dtype, scheme)
    for scheme in ("int8", "int4", "fp8")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
}
ALL_MODES = MODES | WEIGHT_ONLY_MODES


def token_sequences(vocab_size: int, positions: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """``ceil(positions / seq_len)`` seeded random sequences of ``seq_len`` token ids each."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = -(-positions // seq_len)
    return [torch.randint(0, vocab_size, (seq_len,), generator=gen) for _ in range(num_seqs)]


def score_modes(
    model_dir: str, modes: list[str], sequences: list[torch.Tensor], margin: float
) -> dict[str, Any]:
    """Run the reference and every mode over ``sequences``; the ``reference`` and ``modes`` sections.
    A mode this machine cannot run (say w8a8 without VNNI) is reported as ``{"skipped": why}``."""
    fns: dict[str, LogitsFn] = {REFERENCE: ALL_MODES[REFERENCE](model_dir)}
    skipped: dict[str, dict[str, str]] = {}
    for name in modes:
        try:
            fns[name] = ALL_MODES[name](model_dir)
        except ValueError as e:
            skipped[name] = {"skipped": str(e)}
    modes = [name for name in modes if name in fns]
    scores = {name: ModeScore() for name in modes}
    seconds = dict.fromkeys(fns, 0.0)
    margins: list[float] = []
    for i, ids in enumerate(sequences):
        print(f"[sequence {i + 1}/{len(sequences)}]", file=sys.stderr)
        reference = _timed(fns[REFERENCE], ids, seconds, REFERENCE)
        top = reference.topk(2, dim=-1).values
        margins += (top[:, 0] - top[:, 1]).tolist()
        for name in modes:
            scores[name].add(reference, _timed(fns[name], ids, seconds, name), margin)
    return {
        "reference": {
            "mode": REFERENCE,
            "median_top2_margin": statistics.median(margins),
            "confident_fraction": sum(m > margin for m in margins) / len(margins),
            "forward_s": round(seconds[REFERENCE], 3),
        },
        "modes": {name: {**scores[name].summary(), "forward_s": round(seconds[name], 3)} for name in modes}
        | skipped,
    }


def _timed(fn: LogitsFn, ids: torch.Tensor, seconds: dict[str, float], name: str) -> torch.Tensor:
    t0 = time.perf_counter()
    out = fn(ids)
    seconds[name] += time.perf_counter() - t0
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--positions", type=int, default=4096, help="scored positions in all (rounded up)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens of each teacher-forced sequence")
    p.add_argument(
        "--modes", nargs="+", default=DEFAULT_MODES, choices=[m for m in ALL_MODES if m != REFERENCE]
    )
    p.add_argument(
        "--more-schemes",
        "--weight-only",
        dest="weight_only",
        action="store_true",
        help=f"also the modes {', '.join(WEIGHT_ONLY_MODES)}",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.5,
        help="confident positions: HF fp32's top-1 logit leads its top-2 by more than this (nats)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the token sequences")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads; 0 keeps the default")
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv, SMOKE)
    if args.positions < 1 or args.seq_len < 1:
        parser.error("--positions and --seq-len must be at least 1")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dir = resolve_checkpoint(args)
    with open(f"{model_dir}/config.json") as f:
        hf_config = json.load(f)
    max_len = int(hf_config.get("max_position_embeddings", args.seq_len))
    if args.seq_len > max_len:
        parser.error(f"--seq-len {args.seq_len} is past the model's {max_len} positions")
    modes = list(args.modes) + [m for m in WEIGHT_ONLY_MODES if args.weight_only and m not in args.modes]
    sequences = token_sequences(int(hf_config["vocab_size"]), args.positions, args.seq_len, args.seed)
    report: dict[str, Any] = {
        "model": model_dir,
        "config": {k: v for k, v in vars(args).items() if k != "model"},
        "machine": describe(torch.get_num_threads()),
        "num_sequences": len(sequences),
        **score_modes(model_dir, modes, sequences, args.margin),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
