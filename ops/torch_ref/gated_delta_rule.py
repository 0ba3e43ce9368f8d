"""Reference gated delta rule (Qwen3-Next's gated DeltaNet) with a carried state.

Per value head, with ``S`` the ``[Dk, Dv]`` state, each token ``t`` does
``S = exp(g_t) * S``; ``u_t = beta_t * (v_t - S^T k_t)``; ``S = S + k_t u_t^T``; ``o_t = S^T q_t``.

Short segments (decode) run that recurrence token by token. Longer ones run the chunked form: within a
chunk of ``C`` tokens the written values ``U`` solve one unit-lower-triangular system
``(I + A) U = beta * V - (beta * exp(gamma) * K) S0`` (``gamma``: the decay accumulated since the chunk
began; ``A[i, j] = beta_i exp(gamma_i - gamma_j) k_i . k_j`` for ``j < i``), so a chunk costs a few
matmuls and only the chunk-to-chunk state update is sequential. Both forms give the same result up to
float rounding, and running ``0..n`` equals running ``0..k`` then ``k..n`` with the state carried.
Everything is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
MAX_RECURRENT_TOKENS = 8  # segments up to this long run token by token


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
    """``q``, ``k`` ``[B, T, Hk, Dk]``; ``v`` ``[B, T, Hv, Dv]`` (``Hv`` a multiple of ``Hk``: key head
    ``h`` serves value heads ``h * Hv / Hk ..``); ``g`` (log decay, <= 0), ``beta`` ``[B, T, Hv]``;
    ``state`` ``[B, Hv, Dk, Dv]``. Returns ``(out [B, T, Hv, Dv] in v's dtype, new state float32)``."""
    if q.shape[1] <= MAX_RECURRENT_TOKENS:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state, scale, use_qk_l2norm)
    return chunked_gated_delta_rule(q, k, v, g, beta, state, scale, use_qk_l2norm)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` token by token, whatever the length (tests compare the two forms)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    out, state = _recurrent(qf, kf, vf, gf, bf, state.to(torch.float32))
    return out.transpose(1, 2).contiguous().to(v.dtype), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` in chunks of ``chunk_size``, whatever the length."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    out, state = _chunked(qf, kf, vf, gf, bf, state.to(torch.float32), chunk_size)
    return out.transpose(1, 2).contiguous().to(v.dtype), state


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """float32, heads first (``[B, H, T, ...]``), keys repeated over their value heads, q / k
    L2-normalised when asked and q scaled (default ``Dk ** -0.5``)."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.float().repeat_interleave(group, dim=2) if group > 1 else x.float() for x in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    q, k, v, g, beta = (x.float().transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    return q, k, v, g, beta


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-first float32 inputs; the outputs ``[B, H, T, Dv]`` and the final state."""
    out = v.new_empty(v.shape)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        written = (v[:, :, t] - recalled) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * written[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out, state


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads-first float32 inputs; the outputs ``[B, H, T, Dv]`` and the final state. A longer sequence is
    padded to whole chunks with ``beta = 0``, ``g = 0`` and zero keys, which write nothing and decay
    nothing, so the state after the padding is the state after the last real token."""
    length = q.shape[2]
    chunk = min(chunk, length)  # a short segment is one chunk of its own length, unpadded
    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    b, h, n = q.shape[0], q.shape[1], q.shape[2] // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)

    gamma = g.cumsum(dim=-1)  # log decay from the chunk's start through each token
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i (0 above), masked before exp so it cannot overflow
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(above, float("-inf")).exp()
    k_beta = k * beta[..., None]
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = (k_beta @ k.transpose(-1, -2)) * decay * (1.0 - eye) + eye  # I + A, unit lower triangular
    # U = base - recall @ S0: the values each token writes, given the chunk's start state S0
    base = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    recall = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # within-chunk reads, diagonal included
    q_decayed = q * gamma.exp()[..., None]  # reads of the start state
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes decayed to the chunk's end
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    out = v.new_empty(v.shape)
    for i in range(n):
        written = base[:, :, i] - recall[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ written
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ written
    return out.reshape(b, h, n * chunk, -1)[:, :, :length], state
