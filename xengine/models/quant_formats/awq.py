"""AWQ 4-bit checkpoints (AutoAWQ's GEMM layout, what transformers and vLLM load).

Per layer: ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[groups, out / 8]``, both
packed along the output in AWQ's interleaved order (slot ``j`` of a word holds column
``8 * word + [0, 2, 4, 6, 1, 3, 5, 7][j]``), ``scales [groups, out]``; zero points as they are.
w = (q - zero) * scale.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from xengine.models.quant_formats.canonical import QuantizedWeight
from xengine.models.quant_formats.checkpoint import CheckpointQuantization
from xengine.models.quant_formats.layers import LayerInfo, assemble, refuse
from xengine.models.quant_formats.packing import AWQ_ORDER, pack_int32, unpack_int32

_SUPPORTED = "4-bit AWQ in the GEMM layout with zero points"


def parse(qc: dict[str, Any]) -> CheckpointQuantization:
    """The quantization of an AWQ ``quantization_config``; ``ValueError`` naming the field xllm does
    not support."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse("bits", bits, _SUPPORTED)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse("version", qc.get("version"), _SUPPORTED)
    if qc.get("zero_point", True) is not True:
        raise refuse("zero_point", qc.get("zero_point"), _SUPPORTED)
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise refuse("group_size", group_size, "a positive group size or -1")
    # transformers' rule: a module is left in float if any entry is part of its name
    ignore = tuple(f"re:.*{re.escape(m)}.*" for m in qc.get("modules_to_not_convert") or ())
    return CheckpointQuantization("int4", "awq", "gemm", group_size, False, ignore)


def convert(
    weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuantization, layers: dict[str, LayerInfo]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized layer in the canonical form."""

    def build(layer: str, got: dict[str, torch.Tensor], info: LayerInfo) -> QuantizedWeight:
        q = unpack_int32(got["qweight"], 4, dim=1, order=AWQ_ORDER)  # [in, out]
        zero = unpack_int32(got["qzeros"], 4, dim=1, order=AWQ_ORDER)  # [groups, out]
        if q.shape != (info.in_features, info.out_features):
            raise ValueError(f"{layer}.qweight unpacks to {tuple(q.shape)}, expected [in, out]")
        scale = got["scales"].float()
        return QuantizedWeight(q.t().to(torch.uint8).contiguous(), scale.t().contiguous(), zero.t().float())

    return assemble(weights, layers, "int4", ("qweight", "qzeros", "scales"), build)


def pack_layer(layer: str, quantized: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The AWQ GEMM tensors of one layer (scales kept in float32, so they load back exactly)."""
    return {
        f"{layer}.qweight": pack_int32(quantized.q.t(), 4, dim=1, order=AWQ_ORDER),
        f"{layer}.qzeros": pack_int32(quantized.zero.t().to(torch.int32), 4, dim=1, order=AWQ_ORDER),
        f"{layer}.scales": quantized.scale.t().contiguous(),
    }


def write_config(group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` of the checkpoint ``pack_layer`` writes."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
