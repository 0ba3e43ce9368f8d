"""Reading one PEFT LoRA folder: ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``).

Returns every targeted projection's ``A`` (``[rank, in]``) and ``B`` (``[out, rank]``) with the scaling
(``lora_alpha / rank``, or ``/ sqrt(rank)`` under rsLoRA; per module from ``rank_pattern`` /
``alpha_pattern``) folded into ``B``, in float32 on the host. What the engine cannot apply exactly is
refused with a ``ValueError`` that says what: DoRA, LoRA biases, ``modules_to_save`` (whole replaced
layers), embedding adapters, ``fan_in_fan_out`` weights.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

_PREFIX = "base_model.model."
_KEY = re.compile(r"^(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    # module name as PEFT saved it (e.g. "model.layers.0.self_attn.q_proj") -> (A, scaled B)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values()
        )


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's per-module override: the first pattern key that names ``module`` (a suffix or a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(
            f"LoRA adapter {str(path)!r} has no adapter_config.json (expected a PEFT LoRA folder)"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json must be a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r} is a {kind} adapter; only LORA is served")
    for key, bad, what in (
        ("use_dora", True, "DoRA"),
        ("fan_in_fan_out", True, "fan_in_fan_out weights"),
    ):
        if config.get(key) == bad:
            raise ValueError(f"LoRA adapter {str(path)!r} uses {what}, which is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise ValueError(f"LoRA adapter {str(path)!r} trains biases (bias={config['bias']!r}); not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"LoRA adapter {str(path)!r} replaces whole modules (modules_to_save={config['modules_to_save']}); "
            "not supported"
        )
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = path / "adapter_model.bin"
    if pt.is_file():
        return torch.load(str(pt), map_location="cpu", weights_only=True)  # safe loading only
    raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors")


def load_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """The adapter in PEFT folder ``path``; ``ValueError`` if it cannot be served (rank over ``max_rank``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder not found: {path!r}")
    config = read_adapter_config(folder)
    rank_default = int(config.get("r", 8))
    alpha_default = float(config.get("lora_alpha", rank_default))
    rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(folder).items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {path!r} holds {key!r}, which is not a lora_A / lora_B weight (embedding "
                "adapters and extra weights are not supported)"
            )
        module, half = match.groups()
        halves.setdefault(module.removeprefix(_PREFIX), {})[half] = tensor
    adapter = LoRAAdapter(name, str(path), 0)
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} lacks lora_{'AB'[('A' in pair)]}")
        a, b = pair["A"].float(), pair["B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} has mismatched A / B shapes")
        if rank > max_rank:
            raise ValueError(
                f"LoRA adapter {path!r} has rank {rank} (module {module!r}), above max_lora_rank {max_rank}; "
                "raise --max-lora-rank"
            )
        expected_rank = int(_pattern_value(rank_pattern, module, rank_default))
        alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
        if expected_rank != rank:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} has rank {rank}, its config says {expected_rank}"
            )
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        adapter.modules[module] = (a.contiguous(), (b * scaling).contiguous())
        adapter.rank = max(adapter.rank, rank)
    if not adapter.modules:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return adapter
