"""xllm engine layer. ``from xengine import LLM, SamplingParams``.

Imports are lazy so torch-free modules (``xengine.api.messages``, ``xengine.api.text``) can be used by
the service without loading torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from xengine.api.messages import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from xengine.api.lora_request import LoRARequest

        return LoRARequest
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from xengine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'xengine' has no attribute {name!r}")
