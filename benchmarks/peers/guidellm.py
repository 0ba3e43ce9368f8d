"""guidellm, the load generator vLLM's users run, from its own venv (see install_guidellm.sh).

One ``guidellm run`` sweeps a running server at several fixed concurrency levels (its ``concurrent``
profile), each for a fixed time, and writes its JSON report; ``benchmarks/serving/guidellm_report.py``
reads the numbers out of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PEER_DIR = Path(__file__).resolve().parent
GUIDELLM_VENV = Path(os.environ.get("XLLM_BENCH_GUIDELLM_VENV", PEER_DIR / ".venv-guidellm"))
GUIDELLM_BIN = GUIDELLM_VENV / "bin" / "guidellm"
INSTALL_SCRIPT = PEER_DIR / "install_guidellm.sh"
INSTALL_TIMEOUT_S = 1200
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm_available() -> str | None:
    """None when guidellm's venv exists, else the reason it cannot run."""
    if not GUIDELLM_BIN.exists():
        return f"guidellm venv absent ({GUIDELLM_VENV}); run benchmarks/peers/install_guidellm.sh"
    return None


def ensure_guidellm() -> str | None:
    """Install guidellm into its venv unless it is there (pip's progress on stderr); None when it
    is ready, else why not."""
    if guidellm_available() is None:
        return None
    print(f"installing guidellm into {GUIDELLM_VENV} ...", file=sys.stderr)
    env = {**os.environ, "VENV": str(GUIDELLM_VENV)}
    try:
        proc = subprocess.run(
            ["bash", str(INSTALL_SCRIPT)], stdout=sys.stderr, env=env, timeout=INSTALL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"install_guidellm.sh timed out after {INSTALL_TIMEOUT_S} s"
    if proc.returncode != 0:
        return f"install_guidellm.sh failed with exit code {proc.returncode}"
    return guidellm_available()


@dataclass(frozen=True)
class GuidellmLoad:
    """What one sweep sends: synthetic prompts of ``prompt_tokens``, ``output_tokens`` each, at each
    of ``concurrency`` in turn for ``seconds``."""

    concurrency: tuple[int, ...]
    seconds: float
    prompt_tokens: int
    output_tokens: int


def guidellm_cmd(target: str, model_dir: str, load: GuidellmLoad, out_path: Path) -> list[str]:
    """``guidellm run`` against ``target`` (``http://host:port``, no ``/v1``), the tokenizer of
    ``model_dir``, writing its JSON report to ``out_path``."""
    streams = ",".join(f"streams[{i}]={c}" for i, c in enumerate(load.concurrency))
    data = f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.output_tokens}"
    return [
        str(GUIDELLM_BIN),
        "run",
        *("--backend", f"kind=openai_http,target={target}"),
        *("--data", data),
        *("--tokenizer", f"kind=huggingface_auto,model={model_dir}"),
        *("--profile", f"kind=concurrent,{streams}"),
        *("--constraint", f"kind=max_duration,seconds={load.seconds:g}"),
        *("--output", f"kind=json,path={out_path}"),
        "--disable-progress",
    ]


def run_guidellm(cmd: list[str], out_path: Path, timeout_s: float) -> dict:
    """Run ``cmd`` (its console output on stderr) and return its JSON report; raise
    ``RuntimeError`` when it fails or writes none."""
    print(f"running: {' '.join(cmd)}", file=sys.stderr)
    try:
        proc = subprocess.run(
            cmd, stdout=sys.stderr, stderr=sys.stderr, env={**os.environ, **OFFLINE_ENV}, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"guidellm timed out after {timeout_s:.0f} s") from e
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"guidellm exited with code {proc.returncode} and wrote no report")
    return json.loads(out_path.read_text())
