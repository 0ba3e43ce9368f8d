"""Rotary position embedding facade and its cos/sin cache.

The cache is ``[max_position, rotary_dim]`` float32: ``cos`` in the first half of the last dim, ``sin``
in the second, already multiplied by the scaling variant's attention factor (YaRN's mscale), so the
attention scale itself stays ``head_dim ** -0.5``.
"""

from __future__ import annotations

from typing import Any

import torch

from ops.registry import get_op
from ops.rope_scaling import cache_length, compute_inv_freq


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Cos/sin cache covering every position a request may reach under ``scaling``.

    ``scaling`` is the HF ``rope_scaling`` / ``rope_parameters`` dict (``rope_type`` or legacy
    ``type``: default | linear | dynamic | llama3 | yarn); ``max_position`` is the config's
    ``max_position_embeddings``; ``max_len`` (the engine's max_model_len, which the caller checked
    against ``rope_scaling.max_context_len``) extends the cache to cover it."""
    inv_freq, attention_factor = compute_inv_freq(rotary_dim, base, scaling, max_position, max_len)
    length = cache_length(max_position, scaling, max_len)
    positions = torch.arange(length, dtype=torch.float32)
    cache = cos_sin_table(torch.outer(positions, inv_freq), attention_factor)
    return cache.to(device) if device is not None else cache


def cos_sin_table(angles: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``[cos | sin]`` of ``angles`` ([N, rot / 2]) times ``scale``: the ``[N, rot]`` rows the rotary op
    reads (by position from a cache, or one row per token as vision patches build them)."""
    return torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``cos_sin_cache.shape[-1]`` dims of each head of ``q`` ([T, Hq, D]) and ``k``
    ([T, Hkv, D]) by ``positions`` ([T] int64). ``is_neox``: rotate halves (Llama/Qwen), else
    interleaved pairs (GPT-J). Returns ``(q, k)``; backends may work in place, so use the results."""
    return get_op("rotary_embedding")(positions, q, k, cos_sin_cache, is_neox)
