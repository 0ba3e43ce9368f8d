"""The models a server answers to: the base model and its LoRA adapters (``lora.enable_lora``).

A request's ``model`` names the base model (or is empty) or one adapter, whose name then travels to
the engine with the request (``SamplingParams.lora_name``). Adapters come from ``lora.lora_modules``
and, with ``lora.allow_runtime_lora_updating``, from ``POST /v1/load_lora_adapter`` (``routes/lora.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xengine.api.lora_config import LoRAConfig, parse_lora_modules


@dataclass
class LoRAModels:
    enabled: bool
    adapters: dict[str, str] = field(default_factory=dict)  # name -> folder

    @classmethod
    def from_config(cls, config: LoRAConfig) -> LoRAModels:
        return cls(config.enable_lora, dict(parse_lora_modules(config.lora_modules)))

    def adapter_of(self, model: str) -> str | None:
        """The adapter ``model`` names, or None when it names none."""
        return model if model in self.adapters else None
