"""Reference SSD scan (Mamba2's selective state-space model with a scalar decay per head).

Per head ``h`` and token ``t`` with step ``dt`` (already positive: softplus, bias and clamp applied by
the caller), decay ``exp(dt * A[h])`` and the head's group ``g`` of ``B`` / ``C``::

    state = exp(dt * A[h]) * state + dt * x[t] (outer) B[t, g]      # [P, N]
    y[t]  = state @ C[t, g] + D[h] * x[t]                          # [P]

One token (decode) runs that recurrence directly. Longer segments run the chunked (SSD) form: inside a
chunk of ``chunk_size`` tokens the outputs are a masked, decay-weighted attention-like product
(``C B^T``), and the state crosses chunk boundaries by the recurrence; both forms are the same sum, so
splitting a segment anywhere and carrying the state gives the same outputs (up to float rounding).
Everything is computed in float32; the state stays float32.
"""

from __future__ import annotations

import torch


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
    """``x`` ``[Bt, T, H, P]``, ``dt`` ``[Bt, T, H]`` (the discretisation step, > 0), ``A`` ``[H]``
    (negative decay rates), ``B`` / ``C`` ``[Bt, T, G, N]`` (head ``h`` uses group ``h // (H // G)``),
    ``D`` ``[H]`` or None, ``state`` ``[Bt, H, P, N]`` (float32). Returns ``(y [Bt, T, H, P]`` in
    ``x``'s dtype, ``new state [Bt, H, P, N]`` float32)."""
    heads_per_group = x.shape[2] // B.shape[2]
    xf, dtf, Af = x.float(), dt.float(), A.float()
    Bf = B.float().repeat_interleave(heads_per_group, dim=2)  # [Bt, T, H, N]
    Cf = C.float().repeat_interleave(heads_per_group, dim=2)
    s = state.float()
    if x.shape[1] == 1:
        y, s = _recurrent_step(xf[:, 0], dtf[:, 0], Af, Bf[:, 0], Cf[:, 0], s)
        y = y.unsqueeze(1)
    else:
        y, s = _chunked(xf, dtf, Af, Bf, Cf, s, chunk_size)
    if D is not None:
        y = y + xf * D.float()[:, None]
    return y.to(x.dtype), s


def _recurrent_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``x`` ``[Bt, H, P]``, ``dt`` ``[Bt, H]``, ``B`` / ``C`` ``[Bt, H, N]``."""
    decay = torch.exp(dt * A)[..., None, None]  # [Bt, H, 1, 1]
    s = s * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", s, C)
    return y, s


def _chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    s: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk at once: ``x`` ``[Bt, T, H, P]``, ``dt`` ``[Bt, T, H]``, ``B`` / ``C`` ``[Bt, T, H, N]``,
    ``s`` the state before them; returns the outputs (no ``D`` term) and the state after. The segment
    is padded to whole chunks with ``dt = 0`` (no decay, nothing written); the within-chunk products
    and each chunk's own contribution to the state are batched over chunks, and only the hand-over
    of the state from chunk to chunk is a loop (one multiply-add of ``[Bt, H, P, N]`` per chunk)."""
    batch, length, heads = x.shape[:3]
    chunk = min(chunk, length)
    pad = -length % chunk
    if pad:
        x, B, C = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = torch.nn.functional.pad(dt, (0, 0, 0, pad))
    n = x.shape[1] // chunk
    x, B, C = (t.reshape(batch, n, chunk, heads, t.shape[-1]) for t in (x, B, C))
    dt = dt.reshape(batch, n, chunk, heads)
    xdt = x * dt[..., None]
    log_decay = torch.cumsum(dt * A, dim=2).transpose(2, 3)  # [Bt, n, H, L]: from each chunk's start
    # decay from token s (exclusive) to token l (inclusive), zero where s > l; masked before exp so
    # the upper triangle (positive exponents) cannot overflow
    pair = log_decay[..., :, None] - log_decay[..., None, :]  # [Bt, n, H, L, S]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    weights = torch.exp(pair.masked_fill(~causal, float("-inf")))
    scores = torch.einsum("bclhn,bcshn->bchls", C, B) * weights
    y = torch.einsum("bchls,bcshp->bclhp", scores, xdt)
    total = log_decay[..., -1]  # [Bt, n, H]: decay over each whole chunk
    to_end = torch.exp(total[..., None] - log_decay).transpose(2, 3)  # [Bt, n, L, H]
    own = torch.einsum("bclhn,bclhp->bchpn", B * to_end[..., None], xdt)  # each chunk's writes, at its end
    keep = torch.exp(total)[..., None, None]  # [Bt, n, H, 1, 1]
    entering = []
    for c in range(n):  # the state entering each chunk, then after the last
        entering.append(s)
        s = s * keep[:, c] + own[:, c]
    starts = torch.stack(entering, dim=1)  # [Bt, n, H, P, N]
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, starts) * torch.exp(log_decay).transpose(2, 3)[..., None]
    return y.reshape(batch, n * chunk, heads, -1)[:, :length], s
