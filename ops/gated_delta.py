"""Gated delta rule facade (Qwen3-Next's gated DeltaNet): the linear-attention recurrence over a batch
of equally long segments, continuing from the state they start with (``xengine/layers/recurrent.py``
drives it per sequence). The reference is ``ops/torch_ref/gated_delta_rule.py``."""

from __future__ import annotations

import torch

from ops.registry import get_op


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value head and token: ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``out = S^T q``.

    ``q``, ``k``: ``[B, T, Hk, Dk]``; ``v``: ``[B, T, Hv, Dv]`` with ``Hv`` a multiple of ``Hk`` (key head
    ``h`` serves value heads ``h * Hv / Hk`` to ``(h + 1) * Hv / Hk - 1``); ``g`` (log decay, <= 0) and
    ``beta`` (write strength): ``[B, T, Hv]``; ``state``: ``[B, Hv, Dk, Dv]`` (zeros at a sequence's
    start). ``q`` and ``k`` are L2-normalised first when ``use_qk_l2norm``, and ``q`` scaled by ``scale``
    (default ``Dk ** -0.5``). Returns ``(out [B, T, Hv, Dv] in v's dtype, new state [B, Hv, Dk, Dv]
    float32)``; splitting a segment and carrying the state gives the same result."""
    return get_op("gated_delta_rule")(q, k, v, g, beta, state, scale, use_qk_l2norm)
