"""Ascend NPU kernels through ``torch_npu``'s fused operators: the NPU backend's W8A8 linear layers
(``linear_w8a8.py``: ``npu_dynamic_quant`` + ``npu_quant_matmul``, what 910B deployments run).

Registered for "npu" by ``ops/registry.py``. ``torch_npu`` is imported only when a layer runs or is
packed on an NPU, never at import: installing it without CANN breaks ``import torch``, so CPU
environments (and this package's CPU tests) never have it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def npu_kernel_ops() -> dict[str, Callable[..., Any]]:
    """The NPU ops of this package (registered for "npu" by ``ops/registry.py``)."""
    from ops.npu_kernels.linear_w8a8 import pack_linear

    return {"pack_linear": pack_linear}
