"""The "bigram" checkpoint of the speculative-decoding tests and benchmark: a tiny checkpoint with every
attention output projection zeroed, so each next token depends on the current one only. It continues a
prompt that holds its own continuation exactly as that continuation goes, so prompt lookup drafts right
(random tiny models do not repeat themselves, and their drafts are mostly rejected)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_bigram_copy(src: Path, out: Path) -> Path:
    """``src``'s checkpoint copied to ``out`` with its ``self_attn.o_proj`` weights zeroed."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    weights = load_file(str(out / "model.safetensors"))
    for name in weights:
        if name.endswith("self_attn.o_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
