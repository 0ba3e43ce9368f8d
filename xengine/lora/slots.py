"""Device slots: every LoRA-capable projection holds all slots' ``A`` and scaled ``B`` stacked.

A projection of ``S`` stacked checkpoint projections (q|k|v, gate|up: ``MergedLinear``) gets ``S``
rank blocks: ``a[slot]`` is ``[S * max_rank, in]`` and ``b[slot]`` ``[out, S * max_rank]``, block
diagonal, so one pair of matmuls applies an adapter to all of them; an adapter of a smaller rank, or
one that leaves a projection out, fills the rest with zeros. PEFT's module names map onto the
model's as its checkpoint names do (``q_proj`` -> shard 0 of ``qkv_proj``; ``models/weights.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from xengine.layers.linear import Linear, MergedLinear
from xengine.lora.adapter import LoRAAdapter
from xengine.models.weights import STACKED_MODULES

# projections an adapter may target (checkpoint names and the merged ones they load into)
_TARGETS = frozenset({"o_proj", "down_proj", *STACKED_MODULES, *(m for m, _ in STACKED_MODULES.values())})


def lora_layers(model: nn.Module) -> dict[str, Linear]:
    """The model's projections adapters can target, by module name (the decoder layers' attention
    and MLP projections; not the LM head, routers, experts or a vision tower)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Linear) and name.rpartition(".")[2] in _TARGETS and "visual" not in name
    }


class LoRASlots:
    def __init__(
        self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.layers = lora_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no projections LoRA adapters can target")
        self.nbytes = 0
        for layer in self.layers.values():
            rank = _num_shards(layer) * max_rank
            layer.lora_a = torch.zeros(num_slots, rank, layer.in_features, dtype=dtype, device=device)
            layer.lora_b = torch.zeros(num_slots, layer.out_features, rank, dtype=dtype, device=device)
            self.nbytes += layer.lora_a.nbytes + layer.lora_b.nbytes

    def resolve(self, module: str) -> tuple[str, int]:
        """``(layer name, shard)`` of a PEFT module name; ``ValueError`` if the model has no such target."""
        if module in self.layers:
            return module, 0
        parent, _, leaf = module.rpartition(".")
        if leaf in STACKED_MODULES:
            merged, shard = STACKED_MODULES[leaf]
            name = f"{parent}.{merged}" if parent else merged
            if isinstance(self.layers.get(name), MergedLinear):
                return name, shard
        raise ValueError(
            f"the adapter targets {module!r}, which is not a projection of this model LoRA can target "
            "(attention q/k/v/o and MLP gate/up/down of the decoder layers)"
        )

    def check(self, adapter: LoRAAdapter) -> None:
        """``ValueError`` unless every module of ``adapter`` fits this model (names and shapes)."""
        for module, (a, b) in adapter.modules.items():
            name, shard = self.resolve(module)
            layer = self.layers[name]
            rows = layer.output_sizes[shard] if isinstance(layer, MergedLinear) else layer.out_features
            if a.shape[1] != layer.in_features or b.shape[0] != rows:
                raise ValueError(
                    f"adapter {adapter.name!r}: {module!r} is {b.shape[0]}x{a.shape[1]}, the model's is "
                    f"{rows}x{layer.in_features} (an adapter of another base model?)"
                )

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` into ``slot`` (None: clear it)."""
        for layer in self.layers.values():
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
        if adapter is None:
            return
        r = self.max_rank
        for module, (a, b) in adapter.modules.items():
            name, shard = self.resolve(module)
            layer = self.layers[name]
            rank = a.shape[0]
            start = layer.offsets[shard] if isinstance(layer, MergedLinear) else 0
            la, lb = layer.lora_a[slot], layer.lora_b[slot]
            la[shard * r : shard * r + rank].copy_(a)
            lb[start : start + b.shape[0], shard * r : shard * r + rank].copy_(b)


def _num_shards(layer: Linear) -> int:
    return layer.num_shards if isinstance(layer, MergedLinear) else 1
