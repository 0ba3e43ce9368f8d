"""Copy HF-named checkpoint tensors into a model whose q/k/v and gate/up are merged."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from xengine.layers.checkpoint_tensor import materialize
from xengine.layers.linear import MergedLinear
from xengine.layers.moe import EXPERT_PROJECTIONS, FusedExperts

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
# one expert's projection in a per-expert MoE checkpoint: "<...>.experts.<e>.<proj>.weight"
_EXPERT_WEIGHT = re.compile(rf"^(.+\.experts)\.(\d+)\.({'|'.join(EXPERT_PROJECTIONS)})\.weight$")


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
        expert_match = _EXPERT_WEIGHT.match(name)
        if expert_match is not None:
            self._load_expert(name, tensor, *expert_match.groups())  # read only where it is held
            return
        module_path, _, param_name = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        if module_name in STACKED_MODULES and name not in self.params:  # e.g. MLA's own, unmerged q_proj
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
        owner = self.model.get_submodule(module_path) if module_path else self.model
        if hasattr(owner, "load_param"):  # a tensor-parallel layer: it reads only its slice
            owner.load_param(param_name, tensor)
        elif isinstance(owner, FusedExperts):  # every expert stacked: the module keeps the ones it holds
            owner.load_stacked(param_name, tensor)
        elif param.shape != tensor.shape:
            raise ValueError(
                f"weight {name!r}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
            )
        else:
            with torch.no_grad():
                param.copy_(materialize(tensor))
        for shard in range(self._expected_shards(name)):  # a stacked tensor fills every shard at once
            self._mark(name, shard)

    def _load_expert(
        self, name: str, tensor: torch.Tensor, experts_path: str, expert: str, proj: str
    ) -> None:
        module = self._submodule(experts_path, name)
        if not isinstance(module, FusedExperts):
            raise ValueError(f"checkpoint weight {name!r} is for experts, but {experts_path!r} is not one")
        param_name, shard = module.load_expert(int(expert), proj, tensor)
        self._mark(f"{experts_path}.{param_name}", shard)

    def _expected_shards(self, param_name: str) -> int:
        module_path, _, local_name = param_name.rpartition(".")
        module = self.model.get_submodule(module_path)
        if isinstance(module, MergedLinear):
            return module.num_shards
        if isinstance(module, FusedExperts):
            return module.num_shards(local_name)
        return 1

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
            if len(self.loaded.get(name, ())) != self._expected_shards(name):
                missing.append(name)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
