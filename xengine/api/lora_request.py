"""``LoRARequest``: which adapter an offline ``LLM.generate`` / ``LLM.chat`` call runs under, as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Adapter ``lora_name`` from PEFT folder ``lora_path`` (registered on first use). ``lora_int_id``:
    vLLM's numeric id, kept for compatibility (the name identifies the adapter here)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None
