"""The recurrent scans of hybrid models: the C kernel (``ops/cpu_kernels/recurrent_scan.c``) against the
torch reference (``ops/torch_ref/gated_delta_rule.py``, ``ssd.py``) on the same inputs; prints one JSON.

For the gated delta rule (Qwen3-Next) and the SSD scan (Nemotron-H), at three head shapes (make_tiny's
``tiny`` and ``small`` and the released models' own: Qwen3-Next-80B's 16 key / 32 value heads of 128,
Nemotron-H-8B's 128 heads of 64 with 8 groups of state 128), one layer's scan of a ``--prompt-len``
prefill segment and a decode step (one token) at batch 1 and ``--batch``: milliseconds (median of
``--repeats``), the speedup, and the largest difference between the two outputs.

    PYTHONPATH=. .venv/bin/python -m benchmarks.offline.recurrent_scan --num-threads 1
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

from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args

# name -> (key heads, value heads, head dim) / (heads, head dim, groups, state size)
GDN_SHAPES = {"tiny": (2, 4, 32), "small": (4, 8, 64), "qwen3-next-80b": (16, 32, 128)}
SSD_SHAPES = {"tiny": (8, 32, 2, 16), "small": (16, 64, 4, 64), "nemotron-h-8b": (128, 64, 8, 128)}


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _gdn_inputs(bsz: int, length: int, shape: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    hk, hv, d = shape
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(bsz, length, hk, d, generator=gen),
        torch.randn(bsz, length, hk, d, generator=gen),
        torch.randn(bsz, length, hv, d, generator=gen),
        -torch.rand(bsz, length, hv, generator=gen) * 0.3,
        torch.rand(bsz, length, hv, generator=gen),
        torch.randn(bsz, hv, d, d, generator=gen) * 0.1,
    )


def _ssd_inputs(bsz: int, length: int, shape: tuple[int, int, int, int]) -> tuple[Any, ...]:
    heads, p, groups, n = shape
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(bsz, length, heads, p, generator=gen),
        torch.rand(bsz, length, heads, generator=gen) * 0.1,
        -torch.rand(heads, generator=gen),
        torch.randn(bsz, length, groups, n, generator=gen),
        torch.randn(bsz, length, groups, n, generator=gen),
        torch.randn(heads, generator=gen),
        torch.randn(bsz, heads, p, n, generator=gen) * 0.1,
    )


def _compare(kernel: Callable, reference: Callable, args: tuple, repeats: int) -> dict[str, float]:
    k_out, r_out = kernel(*args)[0], reference(*args)[0]
    k_ms, r_ms = _median_ms(lambda: kernel(*args), repeats), _median_ms(lambda: reference(*args), repeats)
    return {
        "kernel_ms": round(k_ms, 4),
        "reference_ms": round(r_ms, 4),
        "speedup": round(r_ms / k_ms, 2),
        "max_abs_diff": float((k_out - r_out).abs().max()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="the decode batch beside batch 1")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", nargs="+", default=["tiny", "small", "released"])
    add_smoke_flag(p)
    args = parse_args(p, argv, {"prompt_len": 40, "batch": 2, "repeats": 1, "shapes": ["tiny"]})
    torch.set_num_threads(args.num_threads)

    from ops.cpu_kernels import recurrent as kernels
    from ops.cpu_kernels.build import unavailable_reason
    from ops.torch_ref import gated_delta_rule as ref_gdn
    from ops.torch_ref import ssd as ref_ssd

    why_not = unavailable_reason("recurrent_scan")
    if why_not is not None:
        print(f"the recurrent_scan kernel does not run here: {why_not}", file=sys.stderr)
        sys.exit(1)
    cases = [("prefill", 1, args.prompt_len), ("decode", 1, 1), ("decode", args.batch, 1)]
    results: dict[str, dict[str, Any]] = {"gated_delta_rule": {}, "ssd_scan": {}}
    for op, shapes, make, kernel, reference in (
        ("gated_delta_rule", GDN_SHAPES, _gdn_inputs, kernels.gated_delta_rule, ref_gdn.gated_delta_rule),
        ("ssd_scan", SSD_SHAPES, _ssd_inputs, kernels.ssd_scan, ref_ssd.ssd_scan),
    ):
        for i, (name, shape) in enumerate(shapes.items()):
            if (name if i < 2 else "released") not in args.shapes:
                continue
            rows = results[op][name] = {"shape": list(shape)}
            for kind, bsz, length in cases:
                print(f"{op} {name} {kind} batch {bsz} x {length} tokens", file=sys.stderr)
                rows[f"{kind}_b{bsz}_t{length}"] = _compare(
                    kernel, reference, make(bsz, length, shape), args.repeats
                )
    out = {"machine": describe(args.num_threads), "config": vars(args), "results": results}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
