"""SSD scan facade: Mamba2's selective state-space scan over segments with a carried state
(``xengine/layers/recurrent.py`` drives it per sequence; the reference is ``ops/torch_ref/ssd.py``)."""

from __future__ import annotations

import torch

from ops.registry import get_op


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scan a batch of equally long segments from ``state``.

    ``x`` ``[B, T, H, P]`` (heads of ``P`` channels); ``dt`` ``[B, T, H]``: the discretisation step,
    already ``softplus(dt + dt_bias)`` and clamped (the caller's per-token work); ``A`` ``[H]``: the
    negative decay rates (``-exp(A_log)``); ``B`` / ``C`` ``[B, T, G, N]``: input / output projections
    of ``G`` groups (head ``h`` reads group ``h // (H // G)``); ``D`` ``[H]``: the skip, or None;
    ``state`` ``[B, H, P, N]`` float32 (zeros at a sequence's start). ``chunk_size``: tokens per block
    of the chunked form (a speed knob, not a result). Returns ``(y [B, T, H, P]`` in ``x``'s dtype,
    ``state after the segment [B, H, P, N]`` float32); cutting a segment anywhere and carrying the
    state gives the same outputs."""
    return get_op("ssd_scan")(x, dt, A, B, C, D, state, chunk_size)
