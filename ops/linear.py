"""Linear facade: ``x @ W^T + b``, with weights a backend may pre-pack once for its GEMM.

``pack_linear(weight, bias)`` asks the current platform's backend for a packed form (oneDNN's blocked
layout on CPU: about twice the fp32 GEMM throughput of plain ``F.linear`` on this project's CPUs);
``None`` means the backend has none for this dtype, and the layer keeps calling ``F.linear``. A packed
weight gets a handle; ``packed_linear(x, handle)`` runs it. Inside a compiled graph it is one opaque
custom op (``xllm::packed_linear``), since packed tensors cannot be traced. Backends receive the
arguments as one ``LinearWeights`` (``ops/quant/weights.py``).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from ops.opaque_op import opaque_op
from ops.quant.weights import LinearWeights
from ops.registry import get_op

# handle -> the backend's packed weight (callable on x, with out_features). Weak: the layer that packed
# it owns it, so a dropped model frees its packed copies too.
_PACKED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count()


def pack_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    float_output: bool = False,
    quantization: str = "none",
    weight_scale: torch.Tensor | None = None,
    weight_zero: torch.Tensor | None = None,
) -> tuple[int, Any] | None:
    """``(handle, packed)`` for ``packed_linear``, or None (use ``F.linear``). Keep ``packed`` alive
    as long as the handle is used. ``float_output``: the caller wants float32 out whatever the input
    (logits); a backend may produce it straight from its accumulators, else the caller converts.

    ``quantization``: "none", "w8a8", "int8", "int4" or "fp8"; a backend that cannot run it raises
    ``ValueError``. With ``weight_scale`` None the weight is quantized here (``ops/quant/``); otherwise
    ``weight`` holds a quantized checkpoint's values (in a float tensor), packed as they are:
    - "w8a8" / "int8": int8 values ``[out, in]``, ``weight_scale`` float32 ``[out]``;
    - "int4": codes in [0, 15] ``[out, in]``, ``weight_scale`` and ``weight_zero`` (integers in
      [0, 15]) float32 ``[out, in / group]``: ``w = (q - zero) * scale``, group ``in / groups``;
    - "fp8": e4m3 values, ``weight_scale`` ``[out]``."""
    weights = LinearWeights(weight, bias, float_output, quantization, weight_scale, weight_zero)
    packed = get_op("pack_linear")(weights)
    if packed is None:
        return None
    handle = next(_NEXT_HANDLE)
    _PACKED[handle] = packed
    return handle, packed


def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """``x @ W^T + b`` with the weight packed under ``handle`` (``[..., in]`` -> ``[..., out]``)."""
    if torch.compiler.is_compiling():
        return _packed_linear_op(x, handle)
    return _PACKED[handle](x)


def _packed_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    packed = _PACKED[handle]
    dtype = torch.float32 if getattr(packed, "float_output", False) else x.dtype
    return x.new_empty(*x.shape[:-1], packed.out_features, dtype=dtype)


@opaque_op("packed_linear(Tensor x, int handle) -> Tensor", _packed_linear_fake)
def _packed_linear_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _PACKED[handle](x)
