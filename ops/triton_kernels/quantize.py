"""Per-token activation quantization and the W8A8 epilogue for the CUDA quantized linears, in Triton.

``quantize_rows`` rounds each row of ``x [m, k]`` to int8 (scale ``amax / 127``) or float8_e4m3fn
(scale ``amax / 448``) in one launch, one program per row, and writes ``q [m_pad, k_pad]`` with the
pad columns and rows as zeros, so the GEMM's shape rules need no pad or cat after it. The arithmetic
is the references' (``ops/quant/int8.quantize_int8``, ``ops/quant/fp8.quantize_fp8_rows``) op for op
in IEEE float32: ``amax`` exact, both divisions correctly rounded (``tl.math.div_rn``, as torch
divides on the CPU; Triton's ``/`` is approximate on the GPU), round half to even, so q and the
scales are bit-equal to the CPU references'. Round half to even is ``(y + 1.5 * 2^23) - 1.5 * 2^23``
(exact in float32 for ``|y| < 2^22``; libdevice's ``rint`` does not run in Triton's interpreter);
e4m3 values are rounded the same way on their own grid (a power-of-two step from ``y``'s exponent)
before the cast, which is then exact on every backend. ``scale_rows_cols`` is W8A8's epilogue:
``acc [m, n] * row_scale * col_scale (+ bias)`` to the output dtype in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT8_MAX = 127.0
E4M3_MAX = 448.0
MAX_BLOCK = 8192  # a row up to this many columns is loaded once; longer rows take two passes
EPILOGUE_BLOCK = 1024  # output columns per program of the epilogue


@triton.jit
def _round_half_even(y):
    # 1.5 * 2^23: adding it to |y| < 2^22 leaves an integer, rounded half to even in float32
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _to_e4m3_grid(y):
    """``y`` (``|y| <= 448``) rounded half to even onto e4m3fn's values, as float32: the step is
    2^(e - 3) for ``|y|`` in [2^e, 2^(e+1)), e >= -6, and 2^-9 (the subnormals) below 2^-6."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    magnitude = _round_half_even(tl.abs(y) * inverse) * step  # both products exact: powers of two
    sign = (bits >> 31) << 31  # keep the sign of a value rounded to 0, as the reference's cast does
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, scale, FP8: tl.constexpr):
    y = tl.math.div_rn(x, scale)
    if FP8:
        return _to_e4m3_grid(tl.minimum(tl.maximum(y, -448.0), 448.0))
    return tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0)


@triton.jit(do_not_specialize=["m"])  # one compiled kernel for decode's one row and prefill's many
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, m, k, x_stride, qmax, K_PAD: tl.constexpr,
    FP8: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_rows = (cols * 0 + row) < m  # rows past m are the GEMM's zero padding: nothing is loaded
    x_row = x_ptr + row.to(tl.int64) * x_stride
    q_row = q_ptr + row.to(tl.int64) * K_PAD
    if K_PAD <= BLOCK:  # the whole row in registers: one read
        x = tl.load(x_row + cols, mask=(cols < k) & in_rows, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        running = tl.zeros([BLOCK], tl.float32)
        for start in range(0, K_PAD, BLOCK):
            mask = (start + cols < k) & in_rows
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(x))
        amax = tl.max(running, axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, qmax), 1.0)  # an all-zero row: scale 1
    tl.store(scale_ptr + row, scale)
    if K_PAD <= BLOCK:
        q = _quantize(x, scale, FP8)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K_PAD)
    else:
        for start in range(0, K_PAD, BLOCK):
            mask = (start + cols < k) & in_rows
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            q = _quantize(x, scale, FP8)
            tl.store(q_row + start + cols, q.to(q_ptr.dtype.element_ty), mask=start + cols < K_PAD)


def quantize_rows(
    x: torch.Tensor, dtype: torch.dtype, k_pad: int, m_pad: int = 0, block: int = MAX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x [m, k]`` (float32 / bfloat16 / float16) to ``dtype`` (``torch.int8`` or
    ``torch.float8_e4m3fn``), symmetric per row: ``(q [max(m, m_pad), k_pad], scale float32
    [max(m, m_pad), 1])``, ``x ~ q * scale``; pad columns and rows are zeros (their scale 1).
    ``block`` caps the columns one program holds at once (a power of two; tests pass small ones)."""
    m, k = x.shape
    if k_pad < k:
        raise ValueError(f"k_pad {k_pad} is below the row length {k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = max(m, m_pad)
    q = torch.empty(rows, k_pad, dtype=dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    fp8 = dtype == torch.float8_e4m3fn
    if not fp8 and dtype != torch.int8:
        raise ValueError(f"quantize_rows writes int8 or float8_e4m3fn, not {dtype}")
    width = min(triton.next_power_of_2(k_pad), block)
    _quantize_rows_kernel[(rows,)](
        x, q, scale, m, k, x.stride(0), E4M3_MAX if fp8 else INT8_MAX, K_PAD=k_pad, FP8=fp8,
        BLOCK=width, num_warps=8 if width >= 4096 else 4,
    )  # fmt: skip
    return q, scale


@triton.jit
def _scale_kernel(
    acc_ptr, out_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, n, acc_stride, out_stride,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    acc = tl.load(acc_ptr + row * acc_stride + cols, mask=mask, other=0).to(tl.float32)
    out = acc * tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows_cols(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``acc [m, n] * row_scale [>= m, 1] * col_scale [n] (+ bias [n])`` in float32, then
    ``out_dtype``: one read of ``acc`` (int32 or float32; a column slice of a wider GEMM output is
    fine), one write of ``[m, n]``."""
    m, n = acc.shape
    out = torch.empty(m, n, dtype=out_dtype, device=acc.device)
    if m == 0 or n == 0:
        return out
    if acc.stride(-1) != 1:
        acc = acc.contiguous()
    grid = (m, triton.cdiv(n, EPILOGUE_BLOCK))
    _scale_kernel[grid](
        acc, out, row_scale, col_scale, col_scale if bias is None else bias, n, acc.stride(0), n,
        HAS_BIAS=bias is not None, BLOCK=EPILOGUE_BLOCK,
    )  # fmt: skip
    return out
