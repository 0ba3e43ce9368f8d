"""CUDA kernels through torch's own GEMMs: the CUDA backend's quantized linear layers.

- ``linear_w8a8.py``: W8A8 int8 (weights per output channel, activations per token, dynamic,
  symmetric) on the int8 tensor cores through ``torch._int_mm``;
- ``linear_fp8.py``: FP8 e4m3 (the same scheme) through ``torch._scaled_mm``, on sm89 and newer;
- ``linear.py``: ``pack_linear`` for "cuda", which picks one of them by ``--quantization``;
- ``quantize.py``: the per-token quantization and output scaling around the GEMMs: Triton's fused
  kernels (``ops/triton_kernels/quantize.py``) on a CUDA device, torch ops on CPU tensors.

Registered for "cuda" by ``ops/registry.py`` beside the Triton kernels; importable without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cuda_kernel_ops() -> dict[str, Callable[..., Any]]:
    """The CUDA ops of this package (registered for "cuda" by ``ops/registry.py``)."""
    from ops.cuda_kernels.linear import pack_linear

    return {"pack_linear": pack_linear}
