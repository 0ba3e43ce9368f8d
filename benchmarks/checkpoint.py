"""The checkpoint a benchmark runs on: a given folder, or a generated one cached by (arch, size)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from xengine.api.envs import cache_dir


def cache_root() -> Path:
    """Where generated benchmark checkpoints are kept (``$XLLM_CACHE_DIR`` or ``~/.cache/xllm``)."""
    root = cache_dir()
    return Path(root) / "bench-models"


def generated_checkpoint(arch: str, size: str, seed: int = 0) -> Path:
    """The folder of make_tiny's (arch, size, seed) checkpoint, generated on first use."""
    from xengine.tools.make_tiny import make_tiny

    target = cache_root() / f"{arch}-{size}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        make_tiny(arch, size, tmp, seed=seed)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """``--model DIR`` or ``--arch`` / ``--size`` (generated with make_tiny into the cache)."""
    p.add_argument("--model", default=None, help="HF-format model folder (overrides --arch/--size)")
    p.add_argument("--arch", default="qwen3", help="architecture of the generated checkpoint")
    p.add_argument(
        "--size", default="tiny", choices=["tiny", "small"], help="size of the generated checkpoint"
    )


def resolve_checkpoint(args: argparse.Namespace) -> str:
    """The model folder named by ``--model``, else the generated ``--arch``/``--size`` one."""
    if args.model:
        return str(Path(args.model).resolve())
    return str(generated_checkpoint(args.arch, args.size))
