"""Reference rotary embedding (computed in float32, cast back to the input dtype).

Each pair ``(x1, x2)`` of a head's rotary dims turns by its angle: ``(x1 cos - x2 sin, x2 cos + x1 sin)``
(``rotate_pair``, the one place the rotation is written). NeoX layout pairs dim ``i`` with
``i + rot / 2``; GPT-J layout pairs neighbours ``2i, 2i + 1``.
"""

from __future__ import annotations

import torch


def rotate_pair(
    x1: torch.Tensor,
    x2: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x1 cos - x2 sin, x2 cos + x1 sin)``, written into ``out`` when given (no new tensors for them)."""
    if out is None:
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin
    torch.mul(x1, cos, out=out[0]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[1]).add_(x1 * sin)
    return out


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Float32 ``x`` rotated over its whole last dim, written into one fresh tensor (no ``cat``)."""
    half = cos.shape[-1]
    out = torch.empty_like(x)
    rotate_pair(x[..., :half], x[..., half:], cos, sin, out=(out[..., :half], out[..., half:]))
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    if is_neox and rot_dim == x.shape[-1] and x.dtype == torch.float32 and not torch.compiler.is_compiling():
        return _rotate_neox(x, cos, sin)  # eager: no cat (a compiler fuses the generic form anyway)
    x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        out = torch.cat(rotate_pair(x1, x2, cos, sin), dim=-1)
    else:
        out = torch.stack(rotate_pair(x_rot[..., 0::2], x_rot[..., 1::2], cos, sin), dim=-1).flatten(-2)
    out = out.to(x.dtype)
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].float().unsqueeze(-2).chunk(2, dim=-1)  # [T, 1, rot/2] each
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)
