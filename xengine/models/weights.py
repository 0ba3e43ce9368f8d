"""Copy HF-named checkpoint tensors into a model whose q/k/v and gate/up are merged."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from xengine.layers.linear import MergedLinear

# checkpoint module name -> (merged module name, shard index)
STACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# checkpoint entries that hold no weights (old checkpoints saved RoPE buffers)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoader:
    """Loads checkpoint tensors into ``model``, checking names and shapes and that every parameter
    (every shard of merged ones) was filled exactly once."""

    def __init__(self, model: nn.Module, skip: tuple[str, ...] = ()) -> None:
        self.model = model
        self.skip = set(skip)
        self.params = dict(model.named_parameters())
        self.loaded: dict[str, set[int]] = {}

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if name in self.skip or name.endswith(IGNORED_SUFFIXES):
                continue
            self._load_one(name, tensor)
        self._check_complete()

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        module_path, _, param_name = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        if module_name in STACKED_MODULES:
            merged_name, shard = STACKED_MODULES[module_name]
            merged_path = f"{parent}.{merged_name}" if parent else merged_name
            module = self._submodule(merged_path, name)
            if not isinstance(module, MergedLinear):
                raise ValueError(f"checkpoint weight {name!r} maps to {merged_path!r}, which is not merged")
            module.load_shard(shard, param_name, tensor)
            self._mark(f"{merged_path}.{param_name}", shard)
            return
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"checkpoint has unexpected weight {name!r} for {type(self.model).__name__}")
        if param.shape != tensor.shape:
            raise ValueError(
                f"weight {name!r}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        self._mark(name, 0)

    def _submodule(self, path: str, weight_name: str) -> nn.Module:
        try:
            return self.model.get_submodule(path)
        except AttributeError as e:
            raise ValueError(f"checkpoint has unexpected weight {weight_name!r}") from e

    def _mark(self, param_name: str, shard: int) -> None:
        shards = self.loaded.setdefault(param_name, set())
        if shard in shards:
            raise ValueError(f"weight {param_name!r} (shard {shard}) appears twice in the checkpoint")
        shards.add(shard)

    def _check_complete(self) -> None:
        missing = []
        for name in self.params:
            module = self.model.get_submodule(name.rpartition(".")[0])
            expected = module.num_shards if isinstance(module, MergedLinear) else 1
            if len(self.loaded.get(name, ())) != expected:
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
