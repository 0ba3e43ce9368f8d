"""CPU kernels in C (AVX-512; all but the GEMMs also AVX2, ``avx512_on_avx2.h``): what the CPU backend
runs where torch's own ops leave time on the table.

- ``panel_gemm.c`` (``linear.py``): linear layers on skinny inputs (decode), streaming each weight
  once with the next panel prefetched while the current one is multiplied;
- ``decode_attention.c`` (``attention.py``): decode attention reading each sequence's K/V in place,
  from the paged cache's blocks or the xTensor slot, with no gather and no padding;
- ``row_argmax.c`` (``reduce.py``): greedy sampling's argmax over the logits rows;
- ``elementwise.c`` (``elementwise.py``): RMSNorm (with the residual add), the SwiGLU gate and NeoX
  RoPE, one pass per row instead of a chain of torch ops (eager steps; traced graphs keep torch's);
- ``recurrent_scan.c`` (``recurrent.py``): the gated delta rule and the SSD scan of hybrid models, each
  (sequence, head) stepping its tokens through a state held in cache.

``build.py`` compiles them once into the cache directory (``ci/setup.sh`` does it ahead) and loads
them with ``ctypes``; ``XLLM_CPU_KERNELS=off`` turns them off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cpu_kernel_ops() -> dict[str, Callable[..., Any]]:
    """The CPU ops these kernels provide (registered for "cpu" by ``ops/registry.py``)."""
    from ops.cpu_kernels import elementwise
    from ops.cpu_kernels.attention import decode_attention, decode_attention_contiguous
    from ops.cpu_kernels.linear import pack_linear
    from ops.cpu_kernels.recurrent import gated_delta_rule, ssd_scan
    from ops.cpu_kernels.reduce import row_argmax

    return {
        "pack_linear": pack_linear,
        "attention": decode_attention,
        "attention_contiguous": decode_attention_contiguous,
        "row_argmax": row_argmax,
        "rms_norm": elementwise.rms_norm,
        "fused_add_rms_norm": elementwise.fused_add_rms_norm,
        "silu_and_mul": elementwise.silu_and_mul,
        "rotary_embedding": elementwise.rotary_embedding,
        "gated_delta_rule": gated_delta_rule,
        "ssd_scan": ssd_scan,
    }
