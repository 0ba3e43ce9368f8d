"""The roofline floor of the offline workload: the least time any engine could take on this machine.

Each phase is timed at the machine's own limits, measured in the same run:

- a prefill step is compute-bound: its model FLOPs over the measured fp32 matmul peak;
- a decode step reads every weight once and every sequence's K and V at its context; its floor is
  ``max(FLOPs / peak, bytes / read bandwidth)``, the bandwidth measured by streaming a buffer as big
  as the step's bytes (so it is L2, L3 or DRAM bandwidth, as the step's working set would be).

The floor assumes perfect kernels (FLOPs at the matmul peak, bytes at the streaming rate, both
overlapped) and no host, dispatch or elementwise time at all; ``elapsed / floor`` of a measured run is
how far that run is from it, and ``floor_fraction_of_peak`` is the most model FLOP/s as a fraction of
the peak that the workload allows (below 1 where decode steps are bound by bytes, not FLOPs).
"""

from __future__ import annotations

import time

import torch

from benchmarks.model_flops import model_dims, prefill_flops


def read_gb_s(num_bytes: int, threads: int, reps: int = 5) -> float:
    """GB/s of a streaming sum over a ``num_bytes`` float32 buffer at ``threads`` threads (best of ``reps``)."""
    torch.set_num_threads(threads)
    x = torch.ones(max(int(num_bytes) // 4, 1 << 16))
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def _phases(
    model_dir: str, batch: int, context: int, bytes_per_param: tuple[float, float, float] = (4, 4, 4)
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((FLOPs, bytes) of the linear layers, (FLOPs, bytes) of attention) of one decode step: every
    weight (LM head included) read once; each sequence's K and V over ``context`` tokens.
    ``bytes_per_param``: (body weights, LM head, KV cache) bytes per value (float32: 4, 4, 4)."""
    d = model_dims(model_dir)
    body, head, kv = bytes_per_param
    linear = (2.0 * batch * (d.body + d.head), body * d.body + head * d.head)
    attention = (
        4.0 * batch * d.layers * context * d.q_width,
        kv * batch * context * 2 * d.layers * d.kv_width,
    )
    return linear, attention


def offline_floor(
    model_dir: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    peak_gflop_s: float,
    threads: int,
    bytes_per_param: tuple[float, float, float] = (4, 4, 4),
) -> dict:
    """The floor of ``num_prompts`` prompts of ``input_len`` tokens, then ``output_len - 1`` decode steps
    of the whole batch (the ``offline_throughput`` workload), at ``threads`` threads; a reduced
    precision is its GEMM peak (``peak_gflop_s``) and its bytes per weight and KV value."""
    peak = peak_gflop_s * 1e9
    mid = input_len + output_len // 2
    linear, attention = _phases(model_dir, num_prompts, mid, bytes_per_param)
    step_bytes = linear[1] + attention[1]
    bandwidth = read_gb_s(step_bytes, threads) * 1e9

    def step_floor_s(context: int) -> tuple[float, float, bool]:
        phases = _phases(model_dir, num_prompts, context, bytes_per_param)
        times = [(flops / peak, num_bytes / bandwidth) for flops, num_bytes in phases]
        return sum(max(t) for t in times), sum(f for f, _ in phases), any(m > c for c, m in times)

    steps = [step_floor_s(input_len + i) for i in range(1, output_len)]
    prefill = prefill_flops(model_dir, num_prompts, input_len)
    prefill_s, decode_s = prefill / peak, sum(s for s, _, _ in steps)
    floor_s = prefill_s + decode_s
    return {
        "read_gb_s": round(bandwidth / 1e9, 1),
        "decode_step_mb": round(step_bytes / 1e6, 1),
        "decode_step_floor_ms": round(step_floor_s(mid)[0] * 1e3, 3),
        "decode_steps_bound_by_bytes": sum(b for _, _, b in steps),
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "floor_s": round(floor_s, 4),
        "floor_output_tok_s": round(num_prompts * output_len / floor_s, 1),
        "floor_fraction_of_peak": round((prefill + sum(f for _, f, _ in steps)) / floor_s / peak, 3),
    }
