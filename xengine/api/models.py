"""Where the embedded default model lives, and the choices of ``xllm model make-tiny`` (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path

ARCHS = ("qwen3", "qwen2", "llama")
SIZES = ("tiny", "small")


def default_model_dir() -> Path:
    """Where the embedded default model (``xllm serve`` without ``--model``) lives."""
    root = os.environ.get("XLLM_CACHE_DIR") or Path.home() / ".cache" / "xllm"
    return Path(root) / "models" / "default-qwen3-small"
