"""Quantized linear layers on CUDA: bf16 ``F.linear`` (cuBLAS) against W8A8 int8 (``torch._int_mm``)
and FP8 e4m3 (``torch._scaled_mm``) as ``ops/cuda_kernels`` runs them, at decode and prefill row
counts on Llama-8B-like shapes; prints one JSON document.

Each time is the median of ``--reps`` calls timed with CUDA events (after warm-up), the whole layer:
the activation quantization, the GEMM and the scaling. ``ms``: eager calls (host launch time shows
where the GPU waits for it); ``graph_ms``: replays of the call captured in a CUDA graph, as the
engine's decode steps run (TFLOP/s and the speed-ups use it). ``w8a8`` / ``fp8`` are the layers as
they run on a GPU, the per-token quantization and the int8 epilogue as Triton kernels
(``ops/triton_kernels/quantize.py``); ``w8a8_torch`` / ``fp8_torch`` are the same layers (same
weights) with the torch ops those kernels replaced, timed in the same run. ``quantize_graph_ms``: the
per-token quantization alone, as the layer calls it (padded columns, and rows for ``_int_mm``), in
each layer's kernels. TFLOP/s (TOP/s for int8) are set against the device's
dense peak where its name is in ``PEAKS`` (the datasheet), and against the bf16 GEMM measured here. On
a machine without CUDA it prints why and exits 0.

    python3 -m benchmarks.cuda.quant_linear
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.smoke import add_smoke_flag, parse_args

ROWS = (1, 16, 128, 2048)
SHAPES = ((4096, 4096), (4096, 14336))  # (in, out): attention out projection, MLP gate/up
# dense (no sparsity) datasheet peaks, TFLOP/s: bf16, and fp8 / int8 (the same on these parts)
PEAKS = {"H100 80GB HBM3": (989.4, 1978.9), "H100": (756.0, 1513.0), "H200": (989.4, 1978.9),
         "A100": (312.0, 624.0), "L40S": (362.1, 733.0), "L4": (121.0, 242.5)}  # fmt: skip


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_replay(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph (as the engine's decode steps run): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _peaks(name: str) -> tuple[float, float] | None:
    for key in sorted(PEAKS, key=len, reverse=True):  # the most specific name first
        if key in name:
            return PEAKS[key]
    return None


def _layers(w: torch.Tensor, fp8: bool) -> dict[str, object]:
    """The quantized layers of ``w`` by name: Triton's kernels around the GEMM, and ``*_torch``, the
    same layer object's copy with the torch ops (the path before the Triton kernels)."""
    from ops.cuda_kernels.linear import pack_linear
    from ops.cuda_kernels.quantize import TORCH_KERNELS
    from ops.quant.weights import LinearWeights

    layers = {"w8a8": pack_linear(LinearWeights(w, quantization="w8a8"))}
    if fp8:
        layers["fp8"] = pack_linear(LinearWeights(w, quantization="fp8"))
    for name in list(layers):
        torch_layer = copy.copy(layers[name])
        torch_layer.kernels = TORCH_KERNELS
        layers[f"{name}_torch"] = torch_layer
    return layers


def _quantize_call(layer: object, x: torch.Tensor) -> Callable[[], object]:
    """The layer's own per-token quantization of ``x``, with the padding it asks for."""
    from ops.cuda_kernels.linear_w8a8 import MIN_ROWS, W8A8Linear
    from ops.quant.fp8 import E4M3

    dtype, min_rows = (torch.int8, MIN_ROWS) if isinstance(layer, W8A8Linear) else (E4M3, 0)
    return lambda: layer.kernels.quantize(x, dtype, layer.padded_in, min_rows)


def _case(rows: int, k: int, n: int, reps: int, fp8: bool) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    layers = {"bf16": lambda: F.linear(x, w), **_layers(w, fp8)}
    flops = 2 * rows * k * n
    out: dict = {"rows": rows, "in": k, "out": n}
    for name, layer in layers.items():
        fn = layer if name == "bf16" else (lambda layer=layer: layer(x))
        ms, graph_ms = _median_ms(fn, reps), _median_ms(_graph_replay(fn), reps)
        out[name] = {
            "ms": round(ms, 4),
            "graph_ms": round(graph_ms, 4),
            "tflops": round(flops / graph_ms / 1e9, 1),
        }
        if name != "bf16":
            out[name]["quantize_graph_ms"] = round(
                _median_ms(_graph_replay(_quantize_call(layer, x)), reps), 4
            )
    for name in layers:
        out[name]["speedup_vs_bf16"] = round(out["bf16"]["graph_ms"] / out[name]["graph_ms"], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="timed calls per layer (median)")
    add_smoke_flag(parser)
    args = parse_args(parser, argv, {"reps": 2})
    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "cuda_quant_linear", "skipped": "no CUDA device in this process"}))
        return
    name = torch.cuda.get_device_name()
    capability = torch.cuda.get_device_capability()
    fp8 = capability >= (8, 9)
    cases = [_case(rows, k, n, args.reps, fp8) for k, n in SHAPES for rows in ROWS]
    peaks = _peaks(name)
    if peaks is not None:
        for case in cases:
            for mode in case:
                if isinstance(case[mode], dict):
                    peak = peaks[0] if mode == "bf16" else peaks[1]
                    case[mode]["of_peak"] = round(case[mode]["tflops"] / peak, 3)
    print(json.dumps({
        "benchmark": "cuda_quant_linear",
        "device": name,
        "capability": f"sm{capability[0]}{capability[1]}",
        "torch": torch.__version__,
        "peak_tflops_bf16_fp8_int8": peaks,
        "fp8": fp8 or "needs sm89+",
        "cases": cases,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
