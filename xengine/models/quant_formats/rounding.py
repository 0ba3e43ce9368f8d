"""The rounding ``--quantization`` applies at load, for the checkpoint writer: the same functions of
``ops/quant`` the kernels' packers call, so a checkpoint written by ``xllm model quantize`` holds
exactly the values the engine would make on the fly from the dense model."""

from __future__ import annotations

import torch

from xengine.models.quant_formats.canonical import QuantizedWeight


def quantize_weight(scheme: str, weight: torch.Tensor) -> QuantizedWeight:
    """``weight [out, in]`` (a dense checkpoint's) rounded as ``scheme`` rounds it on the fly:
    int8 / w8a8 symmetric per output channel, int4 asymmetric per group of 128 inputs, fp8 e4m3 per
    output channel (``amax / 448``)."""
    if scheme in ("w8a8", "int8"):
        from ops.quant.int8 import quantize_int8

        q, scale = quantize_int8(weight)
        return QuantizedWeight(q, scale.float())
    if scheme == "int4":
        from ops.quant.int4 import quantize_int4

        q, scale, zero = quantize_int4(weight)
        if weight.shape[1] % scale.shape[1]:
            raise ValueError(
                f"{weight.shape[1]} inputs do not split into whole groups of "
                f"{-(-weight.shape[1] // scale.shape[1])}; int4 checkpoints need equal groups"
            )
        return QuantizedWeight(q, scale.float(), zero.float())
    if scheme == "fp8":
        from ops.quant.fp8 import quantize_fp8_rows

        q, scale = quantize_fp8_rows(weight)
        return QuantizedWeight(q, scale.float())
    raise ValueError(f"unknown quantization scheme {scheme!r}")
