"""RoPE inverse frequencies for the HF ``rope_scaling`` variants (matches ``transformers``' formulas).

``dynamic`` (NTK) is computed once for the longest supported length (``max_position * factor``, or
the engine's longer ``max_len``), as serving systems do; HF recomputes it per batch from the batch's
longest sequence, so the two agree only for sequences at that length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """Normalised variant name of a ``rope_scaling`` dict (``None`` → "default")."""
    if not scaling:
        return "default"
    name = scaling.get("rope_type", scaling.get("type")) or "default"
    if name not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {name!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return name


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def max_context_len(max_position: int, scaling: dict[str, Any] | None) -> int | None:
    """Longest sequence a variant supports; ``None``: any length.

    Plain RoPE: ``max_position`` (``max_position_embeddings``). Variants that stretch positions
    (linear, llama3, yarn): ``factor * original_max_position_embeddings`` (the original defaulting
    to ``max_position``), or ``max_position`` when that is longer. Dynamic NTK rescales its base for
    the longest sequence, so any length is supported (as in HF)."""
    name = rope_type(scaling)
    if name == "default":
        return max_position
    if name == "dynamic":
        return None
    original = scaling.get("original_max_position_embeddings") or max_position
    return max(max_position, int(original * (scaling.get("factor") or 1.0)))


def cache_length(max_position: int, scaling: dict[str, Any] | None, max_len: int | None = None) -> int:
    """Positions covered by the cos/sin cache: at least ``max_len`` (the engine's max_model_len)."""
    name = rope_type(scaling)
    if name == "dynamic":
        length = int(max_position * scaling["factor"])
    elif name == "yarn":
        original = scaling.get("original_max_position_embeddings") or max_position
        length = max(max_position, int(original * (scaling.get("factor") or 1.0)))
    else:
        length = max_position
    return max(length, max_len or 0)


def compute_inv_freq(
    dim: int, base: float, scaling: dict[str, Any] | None, max_position: int, max_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [dim // 2] float32, attention_factor)`` for rotary dim ``dim``; ``max_len``
    (the engine's max_model_len) only matters to dynamic NTK, which is sized for the longest length."""
    name = rope_type(scaling)
    if name == "default":
        return _base_inv_freq(dim, base), 1.0
    if name == "linear":
        return _base_inv_freq(dim, base) / scaling["factor"], 1.0
    if name == "dynamic":
        factor = scaling["factor"]
        max_len = max(max_position * factor, max_len or 0)
        base = base * ((factor * max_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, base), 1.0
    if name == "llama3":
        return _llama3_inv_freq(dim, base, scaling, max_position), 1.0
    return _yarn_inv_freq(dim, base, scaling, max_position)


def _llama3_inv_freq(dim: int, base: float, scaling: dict[str, Any], max_position: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(dim, base)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling.get("original_max_position_embeddings") or max_position
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    dim: int, base: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    original = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)
