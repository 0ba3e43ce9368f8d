"""``CheckpointQuantization``: what a quantized checkpoint's ``quantization_config`` asks for, as the
format readers (``compressed``, ``gptq``, ``awq``) parse it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

METHODS = ("compressed-tensors", "gptq", "awq")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization: ``scheme`` (the engine's: "w8a8" | "int8" | "int4" | "fp8"),
    ``method`` (the format: "compressed-tensors" | "gptq" | "awq"), ``layout`` (the method's storage
    variant: compressed-tensors' ``format``, GPTQ's ``checkpoint_format``, AWQ's ``version``),
    ``group_size`` (int4: inputs per scale, -1 for the whole row), ``symmetric`` and the layer names it
    leaves alone (``ignore``: names, name suffixes or ``re:`` patterns)."""

    scheme: str
    method: str = "compressed-tensors"
    layout: str = "int-quantized"
    group_size: int = -1
    symmetric: bool = True
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def covers(self, module_name: str) -> bool:
        """Whether the linear layer ``module_name`` (checkpoint naming) is stored quantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True
