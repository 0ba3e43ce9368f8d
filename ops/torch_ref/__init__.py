"""Pure-torch reference backend: the CPU implementation and the fallback/test oracle on every platform."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def reference_ops() -> dict[str, Callable[..., Any]]:
    """Every reference op by name (``ops/registry.py`` registers them for "cpu" and as the fallback);
    ``moe_fused_experts``, composed of the MoE steps through their facade, is registered by ``ops/moe.py``."""
    from ops.torch_ref import moe
    from ops.torch_ref.activation import silu_and_mul
    from ops.torch_ref.attention import attention
    from ops.torch_ref.attention_contiguous import attention_contiguous
    from ops.torch_ref.attention_static import attention_static
    from ops.torch_ref.kv_store import store_kv
    from ops.torch_ref.norm import fused_add_rms_norm, rms_norm
    from ops.torch_ref.reduce import row_argmax
    from ops.torch_ref.rope import rotary_embedding

    return {
        "pack_linear": _no_packed_form,  # layers call F.linear
        "attention": attention,
        "attention_contiguous": attention_contiguous,
        "attention_static": attention_static,
        "store_kv": store_kv,
        "rms_norm": rms_norm,
        "row_argmax": row_argmax,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
        "moe_route": moe.route,
        "moe_route_grouped": moe.route_grouped,
        "moe_dispatch": moe.dispatch,
        "moe_grouped_matmul": moe.grouped_matmul,
        "moe_expert_swiglu": moe.expert_swiglu,
        "moe_combine": moe.combine,
    }


def _no_packed_form(
    weight: Any, bias: Any, float_output: bool = False, quantization: str = "none", weight_scale: Any = None
) -> None:
    """No packed form here: layers call ``F.linear``. Quantized layers need a backend kernel."""
    if quantization != "none":
        raise ValueError(
            f"quantization {quantization} needs the CPU backend's int8 kernel, which this platform lacks; "
            "run without --quantization"
        )
    return None
