"""fp32 GEMM throughput of the linear layers: MKL (``F.linear`` on an input-major weight, as the model
stores it), oneDNN (``ops/onednn``) and the panel kernel (``ops/cpu_kernels``), at one thread count;
prints one JSON document.

Two settings per row count (tokens):

- ``model_sweep``: every projection of the small checkpoint (8 layers' q|k|v, o, gate|up, down and the
  LM head, 160 MB) in turn, as a decode or prefill step runs them: weights come from memory, not cache.
  Printed with the machine's read bandwidth (a streaming sum) and the roofline time
  ``max(weight bytes / bandwidth, FLOPs / peak)`` each kernel is held to;
- ``hot``: one shape repeated (weights in cache), the arithmetic alone.

    PYTHONPATH=. .venv/bin/python -m benchmarks.linear_gemm --num-threads 1
    PYTHONPATH=. .venv/bin/python -m benchmarks.linear_gemm --num-threads 2 --no-sweep \
        --hot-shapes 32x128x256 32x384x128 2048x128x128 2048x384x128 2048x1408x512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.roofline import read_gb_s
from benchmarks.smoke import add_smoke_flag, parse_args
from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.cpu_kernels.linear import PanelLinear
from ops.onednn import OneDNNLinear

# The small checkpoint (hidden 512, 8 heads x 64 with 4 KV heads, intermediate 1408, vocab 32000): (in, out)
SMALL_LAYER = [(512, 1024), (512, 512), (512, 2816), (1408, 512)]
SMALL_MODEL = SMALL_LAYER * 8 + [(512, 32000)]
HOT_SHAPES = [(32, 512, 2816), (32, 1408, 512), (1024, 512, 2816), (2048, 2048, 2048)]


def _seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _kernels(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "mkl": lambda x, w=weight: F.linear(x, w),
        "onednn": OneDNNLinear(weight, None),
    }
    lib = kernel_library("panel_gemm")
    if lib is not None:
        panel = PanelLinear(weight, None, lib)
        out["panel"] = panel
    return out


def read_bandwidth_gb_s() -> float:
    """A streaming sum over 400 MB: what one core (or the threads) read from memory per second."""
    return round(read_gb_s(400_000_000, torch.get_num_threads()), 1)


def matmul_peak_gflop_s() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return round(2 * 2048**3 / _seconds(lambda: torch.mm(a, b), 5) / 1e9, 1)


def model_sweep(rows: list[int], bandwidth: float, peak: float) -> list[dict]:
    weights = [torch.randn(k, n).t() for k, n in SMALL_MODEL]  # input-major [out, in] views
    per_weight = [_kernels(w) for w in weights]
    weight_bytes = sum(w.numel() * 4 for w in weights)
    results = []
    for m in rows:
        inputs = {k: torch.randn(m, k) for k, _ in SMALL_MODEL}
        flops = sum(2 * m * k * n for k, n in SMALL_MODEL)
        roofline = max(weight_bytes / (bandwidth * 1e9), flops / (peak * 1e9))
        row: dict = {"tokens": m, "roofline_ms": round(roofline * 1e3, 2)}
        for name in per_weight[0]:
            fns = [kernels[name] for kernels in per_weight]

            def sweep(fns=fns, inputs=inputs) -> None:
                for (k, _), fn in zip(SMALL_MODEL, fns):
                    fn(inputs[k])

            t = _seconds(sweep, 2 if m <= 256 else 1)
            row[f"{name}_ms"] = round(t * 1e3, 2)
            row[f"{name}_of_roofline"] = round(roofline / t, 3)
        results.append(row)
    return results


def hot(shapes: list[tuple[int, int, int]]) -> list[dict]:
    results = []
    for m, k, n in shapes:
        x, weight = torch.randn(m, k), torch.randn(k, n).t()
        flops = 2 * m * k * n
        row: dict = {"tokens": m, "in": k, "out": n}
        for name, fn in _kernels(weight).items():
            row[f"{name}_gflop_s"] = round(
                flops / _seconds(lambda fn=fn, x=x: fn(x), max(3, int(2e9 / flops))) / 1e9, 1
            )
        results.append(row)
    return results


SMOKE = dict(rows=[1], hot_shapes=["256x256x256"], no_sweep=True)  # 2e9 FLOPs of reps: about 60


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 2048])
    p.add_argument(
        "--hot-shapes",
        nargs="+",
        default=[f"{m}x{k}x{n}" for m, k, n in HOT_SHAPES],
        help="shapes of the 'hot' setting, TOKENSxINxOUT (e.g. the tiny checkpoint's 2048x128x128)",
    )
    p.add_argument("--no-sweep", action="store_true", help="only the 'hot' shapes")
    add_smoke_flag(p)
    args = parse_args(p, argv, SMOKE)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.hot_shapes]
        if any(len(s) != 3 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        p.error(f"--hot-shapes takes TOKENSxINxOUT with positive sizes, got {args.hot_shapes}")
    torch.set_num_threads(args.num_threads)
    bandwidth, peak = read_bandwidth_gb_s(), matmul_peak_gflop_s()
    report = {
        "num_threads": args.num_threads,
        "read_bandwidth_gb_s": bandwidth,
        "matmul_peak_gflop_s": peak,
        "panel_kernel": unavailable_reason("panel_gemm") or "ok",
        "model_sweep": [] if args.no_sweep else model_sweep(args.rows, bandwidth, peak),
        "hot": hot(shapes),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
