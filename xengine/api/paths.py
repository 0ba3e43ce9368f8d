"""Where xllm keeps its files by default: ``$XLLM_CACHE_DIR``, else ``~/.cache/xllm`` (torch-free)."""

from __future__ import annotations

from pathlib import Path

from xengine.api import envs


def cache_dir() -> Path:
    """The root of xllm's cached files (default model, batch store, cluster key)."""
    return envs.cache_dir()


def default_model_dir() -> Path:
    """Where the embedded default model (``xllm serve`` without ``--model``) lives."""
    return cache_dir() / "models" / "default-qwen3-small"


def default_cluster_key_file() -> Path:
    """The cluster key shared by ``xllm engine`` and ``xllm serve`` in attach mode (mode 0600)."""
    return cache_dir() / "cluster.key"
