"""``xllm model make-tiny`` (seeded small checkpoints of real architectures) and ``xllm model quantize``
(a quantized checkpoint of a dense one: W8A8, int8, int4 as compressed-tensors / GPTQ / AWQ, FP8);
each runs in a child process, since they need torch and the service never imports it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from xengine.api.config import QUANTIZATIONS
from xengine.api.models import ARCHS, SIZES
from xservice.commands.common import EXIT_USAGE

SCHEMES = tuple(q for q in QUANTIZATIONS if q != "none")
FORMATS = ("compressed-tensors", "gptq", "awq")


def register_model(subparsers: Any) -> None:
    p = subparsers.add_parser("model", help="model tools (make-tiny, quantize)", description="Model tools.")
    tools = p.add_subparsers(title="model commands", metavar="COMMAND")
    tiny = tools.add_parser(
        "make-tiny",
        help="write a small seeded-random checkpoint of a real architecture",
        description="Write a small seeded-random checkpoint (safetensors + tokenizer) into --out.",
    )
    tiny.add_argument("--arch", choices=ARCHS, default="qwen3", help="model architecture")
    tiny.add_argument("--size", choices=SIZES, default="tiny", help="tiny (~1M params) or small (~56M)")
    tiny.add_argument("--out", required=True, help="output folder")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokenizer corpus")
    tiny.add_argument("--quiet", action="store_true", help="no progress output")
    tiny.set_defaults(run=run_make_tiny)
    quant = tools.add_parser(
        "quantize",
        help="write a quantized checkpoint (compressed-tensors, GPTQ, AWQ) of a dense one",
        description="Round every linear layer but the LM head as --quantization SCHEME does at load (the "
        "same values, so the same tokens) and write a checkpoint that `xllm serve` (and vLLM) loads as "
        "it is: w8a8 (int8 weights and activations), int8 (weight-only), int4 (groups of 128, "
        "asymmetric) or fp8 (e4m3, FP8_DYNAMIC).",
    )
    quant.add_argument("--model", required=True, help="dense Hugging Face model folder")
    quant.add_argument("--out", required=True, help="output folder")
    quant.add_argument("--scheme", choices=SCHEMES, default="w8a8", help="quantization scheme")
    quant.add_argument(
        "--format",
        choices=FORMATS,
        default="compressed-tensors",
        help="checkpoint format: compressed-tensors (every scheme), or gptq / awq (int4 only)",
    )
    quant.add_argument("--quiet", action="store_true", help="no progress output")
    quant.set_defaults(run=run_quantize)
    p.set_defaults(run=lambda _args: (p.print_help(sys.stderr), EXIT_USAGE)[1])


def run_make_tiny(args: argparse.Namespace) -> int:
    argv = ["--arch", args.arch, "--size", args.size, "--out", args.out, "--seed", str(args.seed)]
    cmd = [sys.executable, "-m", "xengine.tools.make_tiny", *argv, *(["--quiet"] if args.quiet else [])]
    return subprocess.run(cmd).returncode


def run_quantize(args: argparse.Namespace) -> int:
    argv = [
        "--model",
        args.model,
        "--out",
        args.out,
        "--scheme",
        args.scheme,
        "--format",
        args.format,
        *(["--quiet"] if args.quiet else []),
    ]
    return subprocess.run([sys.executable, "-m", "xengine.tools.quantize", *argv]).returncode
