"""M-RoPE (Qwen2-VL): rotary positions in three sections, temporal / height / width.

Each token has three position ids; the rotary frequencies are split into ``mrope_section`` groups
(summing to ``rotary_dim / 2``) and group ``i`` rotates by position id ``i``. Text tokens carry the same
id in all three, so for them M-RoPE is plain RoPE at that id: decode steps and text-only prompt chunks
pass one id per token (``[T]``) and run the ordinary rotary op (and graphs); only a step holding image
tokens passes ``[3, T]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ops.rope import rotary_embedding
from xengine.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        mrope_section: Sequence[int],
        scaling: dict[str, Any] | None = None,
        is_neox: bool = True,
    ) -> None:
        super().__init__(rotary_dim, max_position, base, scaling, is_neox)
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must sum to rotary_dim / 2 = {rotary_dim // 2}"
            )
        section_of = np.repeat(np.arange(len(mrope_section)), mrope_section)  # frequency -> section
        self._section_of = torch.from_numpy(np.concatenate([section_of, section_of]))  # cos half, sin half

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().__call__(positions, q, k)
        cache = self.cos_sin_cache(positions.device)  # [L, rotary_dim]
        rows = cache[positions]  # [3, T, rotary_dim]: every section's ids
        index = self._section_of.to(positions.device).view(1, 1, -1).expand(1, rows.shape[1], -1)
        per_token = rows.gather(0, index)[0]  # column j from the section that owns frequency j
        order = torch.arange(positions.shape[1], device=positions.device)
        return rotary_embedding(order, q, k, per_token, self.is_neox)


def mrope_positions(
    num_tokens: int, spans: Sequence[tuple[int, int, Sequence[int]]], merge_size: int
) -> tuple[np.ndarray, int]:
    """``([3, num_tokens] int64 position ids, delta)`` of a prompt whose images fill ``spans``
    (``(offset, length, grid_thw)``, in order, not adjacent), as HF's ``get_rope_index``: text counts
    on from the last id; an image of ``t x h x w`` merged cells starting at id ``s`` gets ``(s + t',
    s + h', s + w')`` for its cell ``(t', h', w')``, and the text after it starts at ``s + max(h, w)``.
    Tokens past the prompt (outputs) sit at ``index + delta``."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    prev = 0  # prompt index where the current text run starts
    next_id = 0  # position id of that index
    for offset, length, (t, h, w) in spans:
        out[:, prev:offset] = np.arange(next_id, next_id + offset - prev)
        next_id += offset - prev
        lh, lw = h // merge_size, w // merge_size
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")).reshape(3, -1)
        if grid.shape[1] != length:
            raise ValueError(f"image at {offset}: {length} pad tokens for a {t}x{lh}x{lw} merged grid")
        out[:, offset : offset + length] = grid + next_id
        next_id += max(lh, lw)
        prev = offset + length
    out[:, prev:] = np.arange(next_id, next_id + num_tokens - prev)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta
