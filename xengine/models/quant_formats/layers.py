"""Gathering each quantized layer's tensors out of the checkpoint stream and handing the model the
canonical ones (``<layer>.weight``, ``<layer>.weight_scale``, ``<layer>.weight_zero``).

A format stores a layer as several tensors (GPTQ: ``qweight``, ``qzeros``, ``scales``); they arrive
in file order, so each layer's parts are held until the last one arrives and then converted at once.
Other tensors pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from xengine.models.quant_formats.canonical import QuantizedWeight


@dataclass(frozen=True)
class LayerInfo:
    """A quantized linear layer as the model has it (one projection of a merged layer)."""

    out_features: int
    in_features: int
    has_bias: bool


Build = Callable[[str, dict[str, torch.Tensor], LayerInfo], QuantizedWeight]
Check = Callable[[str, torch.Tensor, LayerInfo], None]


def refuse(field_name: str, value: Any, supported: str) -> ValueError:
    """The error for an unsupported ``quantization_config.<field_name>``."""
    return ValueError(
        f"quantization_config.{field_name} = {value!r} is not supported; xllm loads {supported}"
    )


def assemble(
    weights: Iterable[tuple[str, torch.Tensor]],
    layers: dict[str, LayerInfo],
    scheme: str,
    parts: tuple[str, ...],
    build: Build,
    checks: dict[str, Check] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with every quantized layer's ``parts`` (tensor name suffixes) replaced by
    its canonical tensors, built by ``build(layer, parts, info)`` once all have arrived. ``checks``:
    suffixes that are only validated (e.g. GPTQ's ``g_idx``) and dropped. ``ValueError`` for parts of
    a layer the model keeps in float, a quantized layer stored in float, or parts that never come."""
    checks = checks or {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        layer, _, suffix = name.rpartition(".")
        info = layers.get(layer)
        if info is None:
            if suffix in parts or suffix in checks or (suffix == "weight" and not _is_float(tensor)):
                if suffix != "weight" or not _is_float(tensor):
                    raise ValueError(
                        f"checkpoint tensor {name!r} is quantized, but xllm keeps {layer!r} in float "
                        "(quantized LM heads, embeddings and MoE experts are not supported)"
                    )
            yield name, tensor  # a layer the model keeps in float (LM head, embeddings, norms, ...)
        elif suffix in checks:
            checks[suffix](name, tensor, info)
        elif suffix in parts:
            got = pending.setdefault(layer, {})
            if suffix in got:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            got[suffix] = tensor
            if len(got) == len(parts):
                quantized = build(layer, pending.pop(layer), info)
                quantized.check(scheme, layer)
                yield from canonical_tensors(layer, quantized)
        elif suffix == "weight":
            raise ValueError(
                f"checkpoint stores {name!r} in float, but its quantization_config quantizes {layer!r}"
            )
        elif suffix == "bias" and not info.has_bias and not tensor.any():
            continue  # some GPTQ writers store an all-zero bias for layers that have none
        else:
            yield name, tensor
    if pending:
        layer, got = next(iter(pending.items()))
        absent = [f"{layer}.{p}" for p in parts if p not in got]
        raise ValueError(f"checkpoint is missing {len(pending)} quantized layers' parts, e.g. {absent}")


def _is_float(tensor: torch.Tensor) -> bool:
    """A dense float tensor (float8 values are quantized ones)."""
    return tensor.is_floating_point() and tensor.itemsize > 1


def canonical_tensors(layer: str, quantized: QuantizedWeight) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the canonical form, as the model's weight loader takes them."""
    yield f"{layer}.weight", quantized.q
    yield f"{layer}.weight_scale", quantized.scale
    if quantized.zero is not None:
        yield f"{layer}.weight_zero", quantized.zero
