"""Quantized arithmetic in torch: the references the quantized kernels of every backend are checked against."""

from __future__ import annotations

from typing import Any

from ops.quant.weights import LinearWeights

SCHEMES = ("w8a8", "int8", "int4", "fp8")


def reference_linear(weights: LinearWeights) -> Any:
    """The torch reference of a quantized linear layer (dequantize and compute; callable on ``x``, with
    ``out_features`` and ``float_output``): what a platform without a kernel for ``quantization`` runs,
    and the oracle of the kernels' tests. ``ValueError`` for an unknown scheme or a zero point where the
    scheme is symmetric."""
    w = weights
    if w.quantization not in SCHEMES:
        raise ValueError(f"unknown quantization {w.quantization!r} (choose one of {', '.join(SCHEMES)})")
    w.check_symmetric()
    from ops.quant.fp8 import ReferenceFP8Linear
    from ops.quant.int4 import ReferenceInt4Linear
    from ops.quant.int8 import ReferenceInt8Linear

    layers = {"int4": ReferenceInt4Linear, "fp8": ReferenceFP8Linear}
    return layers.get(w.quantization, ReferenceInt8Linear)(w)  # int8 and w8a8: ReferenceInt8Linear
