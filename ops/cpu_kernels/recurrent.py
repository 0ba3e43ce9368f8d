"""The gated delta rule and the SSD scan on the C kernel (``recurrent_scan.c``).

Each (sequence, value head) runs its tokens through its own state held in cache, one or two passes
over the state per token: a decode step reads and writes each state once instead of through torch's
five or six ops, and a prefill segment skips the chunked form's small matmuls and triangular solves
(the reference, ``ops/torch_ref/gated_delta_rule.py`` / ``ssd.py``, stays the oracle the tests hold it
to). Inputs of any float dtype are widened to float32 (the state is float32 throughout, as in the
reference) and the output is cast back to the input's dtype. While ``torch.compile`` traces, on
other devices, with gradients or head sizes past ``MAX_HEAD_DIM`` the reference runs.
"""

from __future__ import annotations

import torch

from ops.cpu_kernels.build import kernel_library
from ops.torch_ref import gated_delta_rule as ref_gdn
from ops.torch_ref import ssd as ref_ssd

MAX_HEAD_DIM = 1024  # the kernel keeps a few head-sized vectors on the stack


def _lib(tensors: tuple[torch.Tensor, ...], dims: tuple[int, ...]):  # noqa: ANN202 - a ctypes.CDLL or None
    if torch.compiler.is_compiling() or max(dims) > MAX_HEAD_DIM:
        return None
    if any(t.device.type != "cpu" or t.requires_grad or not t.is_floating_point() for t in tensors):
        return None
    return kernel_library("recurrent_scan")


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous()


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
    """``ops.gated_delta.gated_delta_rule`` (same arguments and results) on the kernel."""
    bsz, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    lib = _lib((q, k, v, g, beta, state), (dk, dv))
    if lib is None or hv % hk:
        return ref_gdn.gated_delta_rule(q, k, v, g, beta, state, scale, use_qk_l2norm)
    qf, kf, vf, gf, bf = (_f32(x) for x in (q, k, v, g, beta))
    state_in = _f32(state)
    state_out = torch.empty_like(state_in)
    out = torch.empty((bsz, length, hv, dv), dtype=torch.float32)
    lib.xllm_gated_delta_f32(
        qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), gf.data_ptr(), bf.data_ptr(),
        state_in.data_ptr(), state_out.data_ptr(), out.data_ptr(),
        bsz, length, hk, hv, dk, dv, dk**-0.5 if scale is None else scale, int(use_qk_l2norm),
        torch.get_num_threads(),
    )  # fmt: skip
    return out.to(v.dtype), state_out


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
    """``ops.ssd.ssd_scan`` (same arguments and results) on the kernel (``chunk_size`` is the
    reference's knob: the kernel has no chunks)."""
    bsz, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    tensors = (x, dt, A, B, C, state) if D is None else (x, dt, A, B, C, D, state)
    lib = _lib(tensors, (p, n))
    if lib is None or heads % groups:
        return ref_ssd.ssd_scan(x, dt, A, B, C, D, state, chunk_size)
    xf, dtf, af, bf, cf = (_f32(t) for t in (x, dt, A, B, C))
    df = None if D is None else _f32(D)
    state_in = _f32(state)
    state_out = torch.empty_like(state_in)
    y = torch.empty((bsz, length, heads, p), dtype=torch.float32)
    lib.xllm_ssd_scan_f32(
        xf.data_ptr(), dtf.data_ptr(), af.data_ptr(), bf.data_ptr(), cf.data_ptr(),
        None if df is None else df.data_ptr(), state_in.data_ptr(), state_out.data_ptr(), y.data_ptr(),
        bsz, length, heads, p, groups, n, torch.get_num_threads(),
    )  # fmt: skip
    return y.to(x.dtype), state_out
