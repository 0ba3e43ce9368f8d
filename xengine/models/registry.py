"""Architecture registry: HF ``architectures[0]`` -> model class, imported lazily (torch-free here)."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS: dict[str, str] = {
    "Qwen3ForCausalLM": "xengine.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "xengine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "xengine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Qwen2ForCausalLM": "xengine.models.qwen2:Qwen2ForCausalLM",
    "LlamaForCausalLM": "xengine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "xengine.models.llama:MistralForCausalLM",
    "Gemma3ForCausalLM": "xengine.models.gemma3:Gemma3ForCausalLM",
    "MiMoV2FlashForCausalLM": "xengine.models.mimo_v2_flash:MiMoV2FlashForCausalLM",
    "Qwen3NextForCausalLM": "xengine.models.qwen3_next:Qwen3NextForCausalLM",
    "NemotronHForCausalLM": "xengine.models.nemotron_h:NemotronHForCausalLM",
    "Qwen2VLForConditionalGeneration": "xengine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "xengine.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    """HF architecture names this engine can run."""
    return sorted(_MODELS)


def check_architecture(architecture: str) -> None:
    """Raise ``ValueError`` naming the supported architectures if ``architecture`` is not one."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())} "
            "(remote code / auto_map is never used)"
        )


def get_model_class(architecture: str) -> Any:
    """The ``BaseCausalLM`` subclass for ``architecture`` (imports torch)."""
    check_architecture(architecture)
    module_name, class_name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)
