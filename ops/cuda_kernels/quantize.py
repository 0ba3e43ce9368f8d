"""Per-token dynamic quantization of activations for the CUDA GEMMs, the row/column padding their
shape rules need, and the scaling of the GEMM's sums: ``token_kernels`` picks Triton's fused kernels
(``ops/triton_kernels/quantize.py``: one launch each) for a layer on a CUDA device where Triton
imports, and the torch ops below elsewhere (CPU tensors, the tests of the layers' host logic).

The torch ops round as the references (``ops/quant/int8.quantize_int8``, ``ops/quant/fp8.
quantize_fp8_rows``) do op for op; an all-zero row keeps a tiny scale instead of 1 (its values are 0
either way, and so is its output), which saves the references' ``where`` on every call. On the GPU,
torch divides by a Python number as a multiply by its reciprocal, so their scales may differ from the
CPU references' in the last bit; the Triton kernels divide exactly and match the CPU bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ops.quant.fp8 import E4M3, E4M3_MAX

INT8_MAX = 127.0
_TINY = torch.finfo(torch.float32).tiny


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def _row_scales(flat: torch.Tensor, qmax: float) -> torch.Tensor:
    # max |x| in x's own dtype (exact), then float32; ``flat / scale`` promotes to float32 as it divides
    amax = flat.abs().amax(dim=-1, keepdim=True).float().clamp_(min=_TINY)
    return amax / qmax


def quantize_int8_tokens(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat [m, k]`` -> ``(q int8 [m, k], scale float32 [m, 1])``: symmetric, per row, nearest even."""
    scale = _row_scales(flat, INT8_MAX)
    return (flat / scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_fp8_tokens(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat [m, k]`` -> ``(q float8_e4m3fn [m, k], scale float32 [m, 1])``: symmetric, per row."""
    scale = _row_scales(flat, E4M3_MAX)
    return (flat / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def as_rows(x: torch.Tensor, in_features: int, padded_in: int) -> torch.Tensor:
    """``x [..., in]`` as rows ``[m, padded_in]``, zero columns appended where the GEMM needs a wider
    ``k`` (zeros change neither a row's max nor its sums)."""
    flat = x.reshape(-1, in_features)
    if padded_in != in_features:
        flat = torch.nn.functional.pad(flat, (0, padded_in - in_features))
    return flat


def scale_output(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``acc [m, n] * row_scale [m, 1] * col_scale [n] + bias [n]`` in float32, then ``out_dtype``."""
    out = acc.float().mul_(row_scale)
    out = out.mul_(col_scale) if bias is None else torch.addcmul(bias, out, col_scale)
    return out.to(out_dtype)


def torch_quantize(
    flat: torch.Tensor, dtype: torch.dtype, k_pad: int, m_pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat [m, k]`` -> ``(q [max(m, m_pad), k_pad], scale float32 [m, 1])`` in torch ops: the
    columns padded before, zero rows appended after (``quantize_rows``'s contract, but for the
    scales of the pad rows, which no caller reads)."""
    rows = flat.shape[0]
    padded = as_rows(flat, flat.shape[1], k_pad)
    quantize = quantize_int8_tokens if dtype == torch.int8 else quantize_fp8_tokens
    q, scale = quantize(padded)
    if m_pad > rows:
        q = torch.cat([q, q.new_zeros(m_pad - rows, k_pad)])
    return q, scale


@dataclass(frozen=True)
class TokenKernels:
    """What a quantized layer calls around its GEMM: ``quantize(flat, dtype, k_pad, m_pad)`` (per-token
    rounding, padded) and ``scale(acc, row_scale, col_scale, bias, out_dtype)`` (the epilogue)."""

    name: str
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    scale: Callable[..., torch.Tensor]


TORCH_KERNELS = TokenKernels("torch", torch_quantize, scale_output)


def token_kernels(device: torch.device) -> TokenKernels:
    """Triton's fused kernels for a layer on a CUDA device where Triton imports (torch's CUDA builds
    ship it); ``TORCH_KERNELS`` elsewhere."""
    if device.type != "cuda":
        return TORCH_KERNELS
    try:
        from ops.triton_kernels.quantize import quantize_rows, scale_rows_cols
    except ImportError:
        return TORCH_KERNELS
    return TokenKernels("triton", quantize_rows, scale_rows_cols)
