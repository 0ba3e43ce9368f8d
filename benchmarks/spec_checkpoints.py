"""Checkpoints derived from make_tiny's for the speculative-decoding tests and benchmark.

- the "bigram" copy: every attention output projection zeroed, so each next token depends on the
  current one only. It continues a prompt that holds its own continuation exactly as that continuation
  goes, so prompt lookup drafts right (random tiny models do not repeat themselves, and their drafts
  are mostly rejected);
- the truncated copy: the first layers only, a cheap draft model with the target's vocabulary."""

from __future__ import annotations

import json
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


def make_truncated_copy(src: Path, out: Path, num_layers: int) -> Path:
    """``src``'s checkpoint with only its first ``num_layers`` decoder layers (the same embeddings, final
    norm and head): a cheap draft model with the target's vocabulary (self-speculation by layer skip)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types",):
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(src / "model.safetensors"))
    kept = {}
    for name, w in weights.items():
        parts = name.split(".")
        if "layers" in parts:
            index = int(parts[parts.index("layers") + 1])
            if index >= num_layers:
                continue
        kept[name] = w
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
