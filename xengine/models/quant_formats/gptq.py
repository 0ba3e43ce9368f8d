"""GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel layout, what transformers and vLLM load).

Per layer: ``qweight`` int32 ``[in / 8, out]`` (eight 4-bit values per word along the input, value
``j`` at bits ``4j``), ``qzeros`` int32 ``[groups, out / 8]`` (packed along the output), ``scales``
``[groups, out]``, ``g_idx`` int32 ``[in]`` (each input's group). w = (q - zero) * scale.

Zero points: ``checkpoint_format: gptq`` (v1, the default) stores zero - 1, so a stored 0xF (a zero
point of 0 wrapped) cannot be read back and is refused; ``gptq_v2`` (GPTQModel) stores them as they
are. Activation order (``desc_act``) is accepted only where ``g_idx`` keeps inputs in group order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from xengine.models.quant_formats.canonical import QuantizedWeight
from xengine.models.quant_formats.checkpoint import CheckpointQuantization
from xengine.models.quant_formats.layers import LayerInfo, assemble, refuse
from xengine.models.quant_formats.packing import pack_int32, unpack_int32

LAYOUTS = ("gptq", "gptq_v2")
_SUPPORTED = "4-bit GPTQ (checkpoint_format gptq or gptq_v2)"


def parse(qc: dict[str, Any]) -> CheckpointQuantization:
    """The quantization of a GPTQ ``quantization_config``; ``ValueError`` naming the field xllm does
    not support."""
    if qc.get("bits") != 4:
        raise refuse("bits", qc.get("bits"), _SUPPORTED)
    layout = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if layout not in LAYOUTS:
        raise refuse("checkpoint_format", layout, _SUPPORTED)
    group_size = qc.get("group_size", 128)
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise refuse("group_size", group_size, "a positive group size or -1")
    if qc.get("lm_head"):
        raise refuse("lm_head", True, "GPTQ checkpoints whose LM head stays in float")
    if qc.get("dynamic"):
        raise refuse("dynamic", qc["dynamic"], "one GPTQ config for every layer")
    return CheckpointQuantization("int4", "gptq", layout, group_size, bool(qc.get("sym", True)))


def convert(
    weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuantization, layers: dict[str, LayerInfo]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized layer in the canonical form."""

    def build(layer: str, got: dict[str, torch.Tensor], info: LayerInfo) -> QuantizedWeight:
        q = unpack_int32(got["qweight"], 4, dim=0)  # [in, out]
        zero = unpack_int32(got["qzeros"], 4, dim=1)[:, : info.out_features]  # [groups, out]
        if quant.layout == "gptq":  # v1 stores zero - 1
            zero = zero + 1
            if zero.max().item() > 15:
                raise ValueError(
                    f"{layer}.qzeros holds a zero point of 0 stored as -1, which GPTQ's v1 format "
                    "(checkpoint_format gptq) cannot represent; re-save it as gptq_v2"
                )
        if q.shape != (info.in_features, info.out_features):
            raise ValueError(f"{layer}.qweight unpacks to {tuple(q.shape)}, expected [in, out]")
        scale = got["scales"].float()
        return QuantizedWeight(q.t().to(torch.uint8).contiguous(), scale.t().contiguous(), zero.t().float())

    def check_g_idx(name: str, g_idx: torch.Tensor, info: LayerInfo) -> None:
        size = info.in_features if quant.group_size == -1 else quant.group_size
        if not torch.equal(g_idx.long(), torch.arange(info.in_features) // size):
            raise ValueError(
                f"{name}: desc_act (activation order) with inputs out of group order is not supported; "
                "use a GPTQ checkpoint quantized with desc_act=false (or static_groups=true)"
            )

    return assemble(weights, layers, "int4", ("qweight", "qzeros", "scales"), build, {"g_idx": check_g_idx})


def pack_layer(layer: str, quantized: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The GPTQ v2 tensors of one layer (scales kept in float32, so they load back exactly)."""
    inp = quantized.q.shape[1]
    return {
        f"{layer}.qweight": pack_int32(quantized.q.t(), 4, dim=0),
        f"{layer}.qzeros": pack_int32(quantized.zero.t().to(torch.int32), 4, dim=1),
        f"{layer}.scales": quantized.scale.t().contiguous(),
        f"{layer}.g_idx": (torch.arange(inp) // quantized.group_size).to(torch.int32),
    }


def write_config(group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` of the checkpoint ``pack_layer`` writes: v2 zero points, since
    asymmetric rounding gives zero points of 0, which v1's zero - 1 cannot hold."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": False,
        "static_groups": False,
        "true_sequential": True,
        "lm_head": False,
        "checkpoint_format": "gptq_v2",
    }
