"""Loading a quantized checkpoint's linear layers: each covered ``Linear`` gets the canonical
parameters (``weight`` holds the quantized values, ``weight_scale``, and for int4 ``weight_zero``;
``quant_formats/canonical.py``), filled by the weight loader like any parameter (merged q|k|v and
gate|up shard by shard), so the layer is packed from the checkpoint's own values, not quantized
again."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from xengine.layers.linear import Linear, MergedLinear
from xengine.models.quant_formats.layers import LayerInfo
from xengine.models.quantization import READERS, CheckpointQuantization
from xengine.models.weights import STACKED_MODULES


def checkpoint_names(name: str, module: Linear) -> list[str]:
    """The checkpoint names of ``module`` (``name`` in our model): one per shard of a merged layer."""
    parent, _, leaf = name.rpartition(".")
    if isinstance(module, MergedLinear):
        shards = sorted((shard, ckpt) for ckpt, (merged, shard) in STACKED_MODULES.items() if merged == leaf)
        leaves = [ckpt for _, ckpt in shards] if len(shards) == module.num_shards else [leaf]
    else:
        leaves = [leaf]
    return [f"{parent}.{leaf}" if parent else leaf for leaf in leaves]


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    """``(name, module)`` of every linear layer a quantized checkpoint may cover (all but the
    float-output ones: the LM head keeps the model's dtype)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not module.float_output:
            yield name, module


def attach_quant_params(model: nn.Module, quant: CheckpointQuantization) -> dict[str, LayerInfo]:
    """Give every linear layer the checkpoint stores quantized its canonical parameters (float32
    ``weight_scale`` ``[out]``, or for int4 ``weight_scale`` and ``weight_zero`` ``[out, in / group]``);
    returns the covered layers by checkpoint name (one per shard). ``ValueError`` for a merged layer
    quantized in part, or inputs that do not split into the checkpoint's groups."""
    layers: dict[str, LayerInfo] = {}
    for name, module in quantizable_linears(model):
        names = checkpoint_names(name, module)
        covered = [quant.covers(n) for n in names]
        if not any(covered):
            continue
        if not all(covered):
            raise ValueError(f"checkpoint quantizes only some of the projections merged into {name!r}")
        out, inp, device = module.out_features, module.in_features, module.weight.device
        shape: tuple[int, ...] = (out,)
        if quant.scheme == "int4":
            group = inp if quant.group_size == -1 else quant.group_size
            if inp % group:
                raise ValueError(f"{name!r}: {inp} inputs do not split into groups of {group} (group_size)")
            shape = (out, inp // group)
            module.weight_zero = nn.Parameter(torch.empty(shape, device=device), requires_grad=False)
        module.weight_scale = nn.Parameter(torch.empty(shape, device=device), requires_grad=False)
        sizes = module.output_sizes if isinstance(module, MergedLinear) and len(names) > 1 else [out]
        for ckpt_name, size in zip(names, sizes):
            layers[ckpt_name] = LayerInfo(size, inp, module.bias is not None)
    return layers


def canonical_weights(
    weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuantization, layers: dict[str, LayerInfo]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every covered layer converted from ``quant.method``'s layout to
    the canonical parameters ``attach_quant_params`` made."""
    return READERS[quant.method].convert(weights, quant, layers)


def pack_quantized_linears(model: nn.Module, scheme: str) -> int:
    """Pack every ``Linear``: the checkpoint's quantized ones in ``scheme`` from their own values,
    the rest (the LM head, ignored layers) in the model's dtype; returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            count += module.pack(scheme if hasattr(module, "weight_scale") else "none")
    return count
