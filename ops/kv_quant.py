"""8-bit KV cache rows (``cache.kv_cache_dtype`` int8 / fp8): the storage format and its reference.

An 8-bit cache keeps the paged shape with a wider last dimension: each token's row of one KV head is
``head_dim`` 8-bit values followed by that row's float32 scale in 4 bytes (``[..., head_dim + 4]``),
so a block carries its own scales and every block-level operation (copy-on-write, prefix caching,
xTensor pages, PD transfer) moves them with the values. The value is ``q * scale``:

- ``int8``: symmetric int8, ``scale = amax / 127``, ``q = round(x / scale)`` (half to even);
- ``fp8``: float8 e4m3fn bits, ``scale = amax / 448``, ``q = fp8(x / scale)`` (nearest even).

A row of zeros gets scale 1. The storage dtype names the format: ``torch.int8`` holds int8 rows,
``torch.uint8`` fp8 rows, so an attention backend tells them apart from the tensor alone. The C
kernels (``ops/cpu_kernels/decode_attention.c``) write and read the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale per (token, KV head) row
# kv_cache_dtype -> storage dtype of the cache tensor
STORAGE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.uint8}
_QMAX = {"int8": 127.0, "fp8": 448.0}


def kv_format(cache: torch.Tensor) -> str | None:
    """``"int8"`` / ``"fp8"`` for an 8-bit cache tensor, None for a float one."""
    if cache.dtype == torch.int8:
        return "int8"
    if cache.dtype == torch.uint8:
        return "fp8"
    return None


def row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of one (token, KV head) row of the cache: ``head_dim``, plus the scale when 8-bit."""
    if kv_cache_dtype not in STORAGE_DTYPES:
        return head_dim
    if head_dim % SCALE_BYTES:
        raise ValueError(
            f"cache.kv_cache_dtype {kv_cache_dtype} needs a head_dim that is a multiple of "
            f"{SCALE_BYTES} (the scale is stored aligned after the values), got {head_dim}"
        )
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows ``x`` (``[..., D]``, any float dtype) as 8-bit cache rows ``[..., D + 4]`` of ``fmt``."""
    xf = x.float()
    head_dim = xf.shape[-1]
    amax = xf.abs().amax(-1, keepdim=True)
    scale = amax / _QMAX[fmt]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale
    out = torch.empty((*xf.shape[:-1], head_dim + SCALE_BYTES), dtype=STORAGE_DTYPES[fmt], device=x.device)
    if fmt == "int8":
        out[..., :head_dim] = torch.round(y).clamp_(-127, 127).to(torch.int8)
    else:
        out[..., :head_dim] = y.clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    out[..., head_dim:].view(torch.float32).copy_(scale)
    return out


def dequantize(rows: torch.Tensor, fmt: str | None = None) -> torch.Tensor:
    """8-bit cache rows ``[..., D + 4]`` as float32 ``[..., D]`` (``fmt``: from the dtype by default)."""
    fmt = fmt or kv_format(rows)
    head_dim = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :head_dim]
    if fmt == "fp8":
        values = values.view(torch.float8_e4m3fn)
    return values.float() * scales(rows)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each 8-bit row: ``[..., 1]``."""
    tail = rows[..., rows.shape[-1] - SCALE_BYTES :]
    try:
        return tail.view(torch.float32)
    except RuntimeError:  # strides that do not allow reinterpreting the bytes in place
        return tail.contiguous().view(torch.float32)


def roundtrip(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """``x`` as an 8-bit cache of ``fmt`` returns it (float32), or ``x`` itself when ``fmt`` is None:
    what attention over freshly computed K/V sees, so it equals attention over the same K/V read back."""
    return x if fmt is None else dequantize(quantize(x, fmt), fmt)
