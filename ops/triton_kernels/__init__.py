"""Triton kernels: the CUDA backend's ops that a captured device graph can replay.

``decode_attention.py`` stores a full device graph's decode K/V and attends over the paged cache
reading lengths, block tables and slots from device tensors only (``attention_static``), so
``graph/full.py`` can capture whole decode steps. Imported only on CUDA (``ops/registry.py``), where
torch ships Triton; the tests run the kernels in Triton's interpreter on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def triton_ops() -> dict[str, Callable[..., Any]]:
    """The ops these kernels provide (registered for "cuda" by ``ops/registry.py``)."""
    from ops.triton_kernels.decode_attention import attention_static

    return {"attention_static": attention_static}
