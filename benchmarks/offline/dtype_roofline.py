"""Which bound holds for each precision of the offline run: the roofline floor per precision.

For each precision our engine ran (``xllm`` at ``--dtype``, and the ``--bf16`` / ``--w8a8`` / ``--int8`` /
``--int4`` variants),
the floor of the same workload (``benchmarks.roofline.offline_floor``) at that precision's own limits,
measured here in the same run: the GEMM peak of the kernel it runs (our panel GEMM in float32, bf16,
W8A8 or weight-only int8 / int4 on a prefill-wide product) and its bytes per weight and KV value. ``fraction_of_floor`` (measured
tok/s over the floor's) is how close the run came to it; ``decode_steps_bound_by_bytes`` counts the
decode steps that bytes, not FLOPs, bound.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.roofline import offline_floor

# section -> (weight dtype, quantization, bytes per (body weight, LM head weight, KV value))
PRECISIONS = {
    "float32": (torch.float32, "none", (4, 4, 4)),
    "bfloat16": (torch.bfloat16, "none", (2, 2, 2)),
    "w8a8": (torch.float32, "w8a8", (1, 4, 4)),
    "w8a8_bfloat16": (torch.bfloat16, "w8a8", (1, 2, 2)),
    # weight-only: int8 codes; int4 codes (half a byte) + a float32 scale and zero per 128 inputs
    "int8": (torch.float32, "int8", (1, 4, 4)),
    "int8_bfloat16": (torch.bfloat16, "int8", (1, 2, 2)),
    "int4": (torch.float32, "int4", (0.5 + 8 / 128, 4, 4)),
    "int4_bfloat16": (torch.bfloat16, "int4", (0.5 + 8 / 128, 2, 2)),
}
PEAK_SHAPE = (512, 1024, 4096)  # rows x in x out: a prefill chunk, wide enough for the kernel's peak


def panel_peak_gflop_s(dtype: torch.dtype, quantization: str, threads: int, reps: int = 5) -> float:
    """GFLOP/s of the packed linear layer our engine runs in this precision, best of ``reps``."""
    from ops.linear import pack_linear

    torch.set_num_threads(threads)
    m, k, n = PEAK_SHAPE
    packed = pack_linear(torch.randn(n, k).to(dtype), None, quantization=quantization)
    layer = packed[1] if packed is not None else lambda x, w=torch.randn(n, k).to(dtype): x @ w.T
    x = torch.randn(m, k).to(dtype)
    layer(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e9


def dtype_rooflines(model_dir: str, args: argparse.Namespace, report: dict) -> dict:
    """``{precision: floor}`` for every precision whose ``xllm`` section ran, with the measured rate."""
    sections = {"xllm": args.dtype if args.quantization == "none" else None}
    sections |= {f"xllm_{name}": name for name in PRECISIONS if name != "float32"}
    threads = args.num_threads or torch.get_num_threads()
    out: dict = {}
    for section, precision in sections.items():
        measured = (report.get(section) or {}).get("output_tok_s")
        if not measured or precision not in PRECISIONS:
            continue
        dtype, quantization, bytes_per_param = PRECISIONS[precision]
        try:
            peak = panel_peak_gflop_s(dtype, quantization, threads)
        except ValueError as e:  # a precision this CPU cannot run
            out[precision] = {"skipped": str(e)}
            continue
        try:
            floor = offline_floor(
                model_dir, args.num_prompts, args.input_len, args.output_len, peak, threads, bytes_per_param
            )
        except TypeError as e:  # int4's fractional bytes per weight: benchmarks/roofline.py wants whole ones
            out[precision] = {"gemm_peak_gflop_s": round(peak, 1), "error": f"{type(e).__name__}: {e}"}
            continue
        out[precision] = {"gemm_peak_gflop_s": round(peak, 1), **floor, "measured_output_tok_s": measured}
        out[precision]["fraction_of_floor"] = round(measured / floor["floor_output_tok_s"], 3)
    return out
