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
        outs = []
        for lo in range(0, x.shape[1], chunk_size):
            hi = lo + chunk_size
            y, s = _chunk(xf[:, lo:hi], dtf[:, lo:hi], Af, Bf[:, lo:hi], Cf[:, lo:hi], s)
            outs.append(y)
        y = torch.cat(outs, dim=1)
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


def _chunk(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of ``L`` tokens: ``x`` ``[Bt, L, H, P]``, ``dt`` ``[Bt, L, H]``, ``B`` / ``C``
    ``[Bt, L, H, N]``, ``s`` the state before it; returns its outputs (no ``D`` term) and the state after."""
    length = x.shape[1]
    xdt = x * dt[..., None]
    log_decay = torch.cumsum(dt * A, dim=1).transpose(1, 2)  # [Bt, H, L]: decay from the chunk's start
    # decay from token s (exclusive) to token l (inclusive), zero where s > l; masked before exp so
    # the upper triangle (positive exponents) cannot overflow
    pair = log_decay[..., :, None] - log_decay[..., None, :]  # [Bt, H, L, S]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    weights = torch.exp(pair.masked_fill(~causal, float("-inf")))
    scores = torch.einsum("blhn,bshn->bhls", C, B) * weights
    y = torch.einsum("bhls,bshp->blhp", scores, xdt)
    # the carried state, decayed to each token, read through C
    y = y + torch.einsum("blhn,bhpn->blhp", C, s) * torch.exp(log_decay).transpose(1, 2)[..., None]
    # the state after the chunk: the old one decayed over the whole chunk, plus each token's update
    # decayed from that token to the chunk's end
    total = log_decay[..., -1]  # [Bt, H]
    to_end = torch.exp(total[..., None] - log_decay).transpose(1, 2)  # [Bt, L, H]
    s = s * torch.exp(total)[..., None, None] + torch.einsum("blhn,blhp->bhpn", B * to_end[..., None], xdt)
    return y, s
