"""Bodies of vLLM's runtime LoRA routes (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)."""

from __future__ import annotations

from typing import ClassVar

from xservice.protocol.base import APIRequest


class LoadLoRAAdapterRequest(APIRequest):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace the weights of an adapter already loaded under this name
    is_3d_lora_weight: bool = False  # vLLM's MoE-expert adapters: refused when true


class UnloadLoRAAdapterRequest(APIRequest):
    ignored_fields: ClassVar[dict[str, str]] = {
        "lora_int_id": "vLLM's numeric adapter id; adapters are known by their name here",
    }

    lora_name: str
