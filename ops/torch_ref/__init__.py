"""Pure-torch reference backend: the CPU implementation and the fallback/test oracle on every platform."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ops.quant.weights import LinearWeights


def reference_ops() -> dict[str, Callable[..., Any]]:
    """Every reference op by name (``ops/registry.py`` registers them for "cpu" and as the fallback);
    ``moe_fused_experts``, composed of the MoE steps through their facade, is registered by ``ops/moe.py``."""
    from ops.torch_ref import moe
    from ops.torch_ref.activation import gelu_tanh_and_mul, silu_and_mul
    from ops.torch_ref.attention import attention
    from ops.torch_ref.attention_contiguous import attention_contiguous
    from ops.torch_ref.attention_static import attention_static
    from ops.torch_ref.causal_conv1d import causal_conv1d
    from ops.torch_ref.kv_store import store_kv
    from ops.torch_ref.norm import fused_add_rms_norm, rms_norm
    from ops.torch_ref.reduce import row_argmax
    from ops.torch_ref.rope import rotary_embedding

    return {
        "pack_linear": pack_linear,  # None (layers call F.linear) unless quantized
        "attention": attention,
        "attention_contiguous": attention_contiguous,
        "attention_static": attention_static,
        "store_kv": store_kv,
        "rms_norm": rms_norm,
        "row_argmax": row_argmax,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul,
        "causal_conv1d": causal_conv1d,
        "gated_delta_rule": _lazy("ops.torch_ref.gated_delta_rule", "gated_delta_rule"),
        "ssd_scan": _lazy("ops.torch_ref.ssd", "ssd_scan"),
        "moe_route": moe.route,
        "moe_route_grouped": moe.route_grouped,
        "moe_dispatch": moe.dispatch,
        "moe_grouped_matmul": moe.grouped_matmul,
        "moe_expert_swiglu": moe.expert_swiglu,
        "moe_combine": moe.combine,
    }


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """An op imported on its first call (recurrent-mixer references only their models use)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


def pack_linear(weights: LinearWeights) -> Any:
    """No packed form for plain weights (layers call ``F.linear``); a quantized layer gets the torch
    reference of its scheme (``ops/quant``: dequantize and compute), slow but exact to the scheme."""
    if weights.quantization == "none":
        return None
    from ops.quant import reference_linear

    return reference_linear(weights)
