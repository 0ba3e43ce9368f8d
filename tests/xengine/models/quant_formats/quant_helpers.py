"""Shared by the quantized-checkpoint tests: loading a checkpoint's canonical tensors unpacked, and the
dense model's layers as the engine's merged modules hold them."""

from __future__ import annotations

from pathlib import Path

import torch

from xengine.layers.linear import Linear
from xengine.models.loader import load_model
from xengine.models.quant_formats.canonical import QuantizedWeight


def load_unpacked(model_dir: Path) -> torch.nn.Module:
    """The model of ``model_dir`` in float32 on the CPU with its layers unpacked (canonical tensors)."""
    return load_model(str(model_dir), torch.float32, torch.device("cpu"), pack=False)


def canonical_layers(model: torch.nn.Module) -> dict[str, QuantizedWeight]:
    """Every quantized linear layer of ``model`` (merged names) as the loader filled it."""
    return {
        name: QuantizedWeight(m.weight.detach().clone(), m.weight_scale, getattr(m, "weight_zero", None))
        for name, m in model.named_modules()
        if isinstance(m, Linear) and hasattr(m, "weight_scale")
    }


def dense_layers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every linear weight of ``model`` but the LM head (merged names), float32."""
    return {
        name: m.weight.detach().float()
        for name, m in model.named_modules()
        if isinstance(m, Linear) and not m.float_output
    }
