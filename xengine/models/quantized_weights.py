"""Loading a quantized checkpoint's linear layers: a ``weight_scale`` per covered layer, filled by the
weight loader like any parameter (merged q|k|v and gate|up shard by shard), so the layer is packed from
the checkpoint's own int8 values and scales, not quantized again."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from xengine.layers.linear import Linear, MergedLinear
from xengine.models.quantization import CheckpointQuantization
from xengine.models.weights import STACKED_MODULES

SCALE_SUFFIX = ".weight_scale"


def checkpoint_names(name: str, module: Linear) -> list[str]:
    """The checkpoint names of ``module`` (``name`` in our model): one per shard of a merged layer."""
    parent, _, leaf = name.rpartition(".")
    if isinstance(module, MergedLinear):
        shards = sorted((shard, ckpt) for ckpt, (merged, shard) in STACKED_MODULES.items() if merged == leaf)
        leaves = [ckpt for _, ckpt in shards] if len(shards) == module.num_shards else [leaf]
    else:
        leaves = [leaf]
    return [f"{parent}.{leaf}" if parent else leaf for leaf in leaves]


def attach_weight_scales(model: nn.Module, quant: CheckpointQuantization) -> int:
    """Give every linear layer the checkpoint stores quantized a float32 ``weight_scale [out]``
    parameter (the LM head and ignored layers keep none); returns how many. ``ValueError`` for a merged
    layer whose projections are quantized in part."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.float_output:
            continue
        covered = [quant.covers(n) for n in checkpoint_names(name, module)]
        if not any(covered):
            continue
        if not all(covered):
            raise ValueError(f"checkpoint quantizes only some of the projections merged into {name!r}")
        scale = torch.empty(module.out_features, dtype=torch.float32, device=module.weight.device)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        count += 1
    return count


def scales_as_vectors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with each ``weight_scale [out, 1]`` as a float32 vector ``[out]``."""
    for name, tensor in weights:
        yield (name, tensor.reshape(-1).float()) if name.endswith(SCALE_SUFFIX) else (name, tensor)
