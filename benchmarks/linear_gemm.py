"""fp32 GEMM throughput of the linear layers' shapes: ``F.linear`` (MKL sgemm) vs a oneDNN-packed weight
(``ops/onednn``), at a given thread count; prints one JSON document.

    PYTHONPATH=. .venv/bin/python -m benchmarks.linear_gemm --num-threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from ops.onednn import OneDNNLinear

# (tokens, in, out): the small checkpoint's projections at decode (8, 32 tokens) and prefill (1024), a square peak
SHAPES = [(8, 512, 2816), (32, 512, 1536), (32, 512, 2816), (32, 1408, 512), (32, 512, 32000), (1024, 512, 2816),
          (2048, 2048, 2048)]  # fmt: skip


def _gflops(fn, flops: int, reps: int) -> float:
    for _ in range(3):
        fn()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = max(best, flops * reps / (time.perf_counter() - t0) / 1e9)
    return round(best, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    rows = []
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        packed = OneDNNLinear(w, None)
        flops = 2 * m * k * n
        reps = max(3, int(2e9 / flops))
        row = {"tokens": m, "in": k, "out": n}
        row["f_linear_gflop_s"] = _gflops(lambda x=x, w=w: F.linear(x, w), flops, reps)
        row["onednn_packed_gflop_s"] = _gflops(lambda x=x, p=packed: p(x), flops, reps)
        row["speedup"] = round(row["onednn_packed_gflop_s"] / row["f_linear_gflop_s"], 2)
        rows.append(row)
    print(json.dumps({"num_threads": args.num_threads, "shapes": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
