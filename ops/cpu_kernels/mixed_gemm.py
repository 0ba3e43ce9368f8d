"""The call shared by the reduced-precision panel GEMMs (bf16, W8A8): rows in, rows out."""

from __future__ import annotations

from collections.abc import Callable

import torch


def mixed_gemm(
    x: torch.Tensor, out_features: int, float_output: bool, gemm: Callable[[int, int, int, int, int], None]
) -> torch.Tensor:
    """Run a reduced-precision panel GEMM on float32 or bfloat16 ``x [..., in]``: ``x`` as contiguous
    rows, the output in ``x``'s dtype (float32 with ``float_output``), ``gemm(x_ptr, rows, x_is_bf16,
    out_ptr, out_is_bf16)`` filling it."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out_dtype = torch.float32 if float_output else x.dtype
    out = torch.empty(flat.shape[0], out_features, dtype=out_dtype, device=x.device)
    gemm(
        flat.data_ptr(),
        flat.shape[0],
        int(x.dtype == torch.bfloat16),
        out.data_ptr(),
        int(out_dtype == torch.bfloat16),
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
