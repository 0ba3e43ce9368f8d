"""RMSNorm, the SwiGLU gate and NeoX RoPE on the C kernel (``elementwise.c``): one pass per row each.

Eager steps run these instead of torch's op chains (six ops per norm, two per gate, six per
rotation), which cost a prefill step of the tiny model a third of its time and a decode step one
dispatch each. While ``torch.compile`` traces (partial graph mode) the reference runs, so inductor
sees plain torch ops it can fuse.

float32 and bfloat16 take the kernels (bfloat16: float32 inside, each result rounded once to nearest
even; RoPE's cos/sin cache stays float32). Every tensor of a call must have the one dtype (the cache
float32), else the call runs the reference: a bfloat16 activation with a float32 norm weight, say, gets
the reference's type promotion. Other dtypes and rows that are not contiguous run the reference too.
"""

from __future__ import annotations

import torch

from ops.cpu_kernels.build import kernel_library
from ops.torch_ref import activation as ref_act
from ops.torch_ref import norm as ref_norm
from ops.torch_ref import rope as ref_rope

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _lib(*tensors: torch.Tensor):  # noqa: ANN202 - a ctypes.CDLL or None
    """The kernel library where ``tensors`` are CPU tensors of one kernel dtype, else None."""
    if torch.compiler.is_compiling():
        return None
    dtype = tensors[0].dtype
    if dtype not in _KERNEL_DTYPES:
        return None
    if any(t.dtype != dtype or t.device.type != "cpu" or t.requires_grad for t in tensors):
        return None
    return kernel_library("elementwise")


def _fn(lib, name: str, dtype: torch.dtype):  # noqa: ANN001, ANN202 - ctypes
    """Kernel ``name`` for float32 tensors, ``name``_bf16 for bfloat16 ones."""
    return getattr(lib, name if dtype == torch.float32 else f"{name}_bf16")


def _rows(x: torch.Tensor, n: int) -> torch.Tensor | None:
    """``x`` as a ``[rows, n]`` view with contiguous rows, or None (no exception on the hot path)."""
    if x.dim() == 0 or x.numel() == 0 or x.shape[-1] != n or x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x
    return x.view(-1, n) if x.is_contiguous() else None


def _row_grid(x: torch.Tensor, n: int) -> tuple[int, int, int, int] | None:
    """``(outer, inner, outer stride, inner stride)`` of the rows of ``x`` (last dim ``n``
    contiguous): 2-D ``[rows, n]``, 3-D ``[T, heads, n]`` with any strides, or contiguous; else None."""
    if x.dim() == 0 or x.numel() == 0 or x.shape[-1] != n or x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    return (x.numel() // n, 1, n, 0) if x.is_contiguous() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lib = _lib(x, weight)
    n = x.shape[-1] if x.dim() else 0
    grid = _row_grid(x, n) if lib is not None and weight.is_contiguous() and weight.numel() == n else None
    if grid is None:
        return ref_norm.rms_norm(x, weight, eps)
    outer, inner, so, si = grid
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel = _fn(lib, "xllm_rms_norm", x.dtype)
    kernel(x.data_ptr(), outer, inner, so, si, None, 0, 0, weight.data_ptr(), out.data_ptr(), n, eps,
           torch.get_num_threads())  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the sum is written into ``x`` (as the reference)."""
    lib = _lib(x, residual, weight)
    n = x.shape[-1] if x.dim() else 0
    ok = lib is not None and x.shape == residual.shape and weight.is_contiguous() and weight.numel() == n
    grid, res = (_row_grid(x, n), _row_grid(residual, n)) if ok else (None, None)
    if grid is None or res is None or grid[:2] != res[:2]:
        return ref_norm.fused_add_rms_norm(x, residual, weight, eps)
    outer, inner, so, si = grid
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel = _fn(lib, "xllm_rms_norm", x.dtype)
    kernel(x.data_ptr(), outer, inner, so, si, residual.data_ptr(), res[2], res[3], weight.data_ptr(),
           out.data_ptr(), n, eps, torch.get_num_threads())  # fmt: skip
    return out, x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = _lib(x)
    width = x.shape[-1] if x.dim() else 0
    rows = _rows(x, width) if lib is not None and width % 2 == 0 else None
    if rows is None:
        return ref_act.silu_and_mul(x)
    n = width // 2
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    kernel = _fn(lib, "xllm_silu_and_mul", x.dtype)
    kernel(rows.data_ptr(), rows.stride(0), out.data_ptr(), n, rows.shape[0], n, torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _lib(q, k)  # the cache: float32 (the model's, whatever its dtype) on the CPU
    cache_ok = cos_sin_cache.dtype == torch.float32 and cos_sin_cache.device.type == "cpu"
    if lib is None or not cache_ok or not is_neox or not _rope_shapes(positions, q, k, cos_sin_cache):
        return ref_rope.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    tokens, hq, dim = q.shape
    hk = k.shape[1]
    pos = (
        positions
        if positions.dtype == torch.int64 and positions.is_contiguous()
        else positions.long().contiguous()
    )
    q_out = torch.empty(tokens, hq, dim, dtype=q.dtype)
    k_out = torch.empty(tokens, hk, dim, dtype=k.dtype)
    kernel = _fn(lib, "xllm_rope_neox", q.dtype)
    kernel(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), pos.data_ptr(), cos_sin_cache.data_ptr(),
           cos_sin_cache.stride(0), q_out.data_ptr(), k_out.data_ptr(), tokens, hq, hk, dim,
           torch.get_num_threads())  # fmt: skip
    return q_out, k_out


def _rope_shapes(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whole-head rotation of [T, H, D] q and k (heads contiguous per token) by 1-D positions."""
    if positions.dim() != 1 or q.dim() != 3 or k.dim() != 3 or cache.dim() != 2 or cache.stride(1) != 1:
        return False
    tokens, _, dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != dim or positions.shape[0] != tokens or tokens == 0:
        return False
    if cache.shape[1] != dim or dim % 2:
        return False
    return all(t.stride(2) == 1 and t.stride(1) == dim for t in (q, k))
