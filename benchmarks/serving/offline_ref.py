"""Our engine's offline rate on the serving benchmark's shape, to put a serving rate beside.

``benchmarks.offline_throughput``'s xllm section in a fresh process (its own thread count, no torch
state of ours): one ``generate`` of ``batch`` prompts of ``prompt_tokens`` random ids, ``output_tokens``
each, greedy, EOS ignored, in the dtype the served xllm ran (``auto`` unless given).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.xllm_server import REPO_ROOT

TIMEOUT_S = 1800


def offline_cmd(
    model_dir: str, batch: int, prompt_tokens: int, output_tokens: int, num_threads: int, dtype: str = "auto"
) -> list[str]:
    """The ``offline_throughput`` command line of the reference run."""
    return [
        *(sys.executable, "-m", "benchmarks.offline_throughput", "--model", model_dir),
        *("--num-prompts", str(batch), "--max-num-seqs", str(batch)),
        *("--input-len", str(prompt_tokens), "--output-len", str(output_tokens)),
        *("--num-threads", str(num_threads), "--dtype", dtype),
        *("--no-hf", "--no-vllm", "--no-eta", "--no-prefix"),
    ]


def offline_reference(
    model_dir: str, batch: int, prompt_tokens: int, output_tokens: int, num_threads: int, dtype: str = "auto"
) -> dict:
    """``{"output_tok_s", "batch", "num_threads", "command", ...}``, or ``{"error": ...}``."""
    cmd = offline_cmd(model_dir, batch, prompt_tokens, output_tokens, num_threads, dtype)
    print(f"offline reference: {' '.join(cmd)}", file=sys.stderr)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    out = {"batch": batch, "num_threads": num_threads, "command": cmd}
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return out | {"error": f"timed out after {TIMEOUT_S} s"}
    if proc.returncode != 0:
        return out | {"error": f"exit code {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
    xllm = json.loads(proc.stdout).get("xllm", {})
    if "output_tok_s" not in xllm:
        return out | {"error": f"no xllm result: {xllm}"}
    return out | {
        k: xllm[k] for k in ("output_tok_s", "elapsed_s", "num_output_tokens", "num_steps") if k in xllm
    }
