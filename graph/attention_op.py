"""Attention as one opaque custom op (``xllm::attention``), so compiled graphs keep it eager.

Graph runners compile everything around attention (norms, projections, RoPE, MLP, residuals); the
op itself runs the platform's attention (``ops.attention``) on the step's metadata and caches from
the forward context. Rows past the context's ``num_tokens`` are bucket padding: they are not
written to the KV cache and come back as zeros. Outside any context (a capture run) it returns zeros.
"""

from __future__ import annotations

import torch

from graph.forward_context import get_forward_context
from graph.interrupt import check_interrupt
from ops.attention import attention
from ops.opaque_op import opaque_op


def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q)


_SCHEMA = "attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int window, Tensor? sinks=None)"


@opaque_op(f"{_SCHEMA} -> Tensor", _attention_fake)
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    ctx = get_forward_context()
    if ctx is None or ctx.meta is None:
        return torch.zeros_like(q)
    if not ctx.resumable_checks:  # an online arrival stops an offline step here, between layers
        check_interrupt(ctx, layer)
    sliding = window if window > 0 else None
    meta = ctx.meta_of(layer)
    n = ctx.num_tokens
    if n == q.shape[0]:
        return attention(q, k, v, ctx.caches[layer], meta, scale, sliding, sinks)
    out = torch.zeros_like(q)
    out[:n] = attention(q[:n], k[:n], v[:n], ctx.caches[layer], meta, scale, sliding, sinks)
    return out


def unified_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of layer ``layer`` over the step in the forward context (``[T, Hq, D]`` in and out);
    ``sinks`` ([Hq] float32): per-head attention-sink logits (``ops/attention.py``), None for none."""
    return _attention_op(q, k, v, layer, scale, sliding_window or 0, sinks)
