"""The plain handle the MoE ops pass from ``dispatch`` to ``combine`` (``ops/moe.py``).

In a module of its own so that backends (``ops/torch_ref/moe.py``, expert parallelism) build it
without importing the facade, which looks the backends up: no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchedTokens:
    """Rows for the experts of this process, grouped by expert, and how to put them back.

    ``hidden[r]`` is token ``order[r] // top_k``'s input for its ``order[r] % top_k``-th expert; the rows
    of expert ``e`` follow those of expert ``e - 1`` (``tokens_per_expert[e]`` of them, host ints so
    backends can loop or size kernels without a device sync)."""

    hidden: torch.Tensor  # [N, H]
    tokens_per_expert: list[int]  # [E]
    order: torch.Tensor  # [N] int64, flat (token * top_k + slot) index of each row
    num_tokens: int
    top_k: int
