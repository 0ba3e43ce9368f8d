"""Quantized checkpoints: what a ``quantization_config`` asks for, and which linear layers it covers.

We load the compressed-tensors W8A8 int8 scheme (llm-compressor's ``W8A8`` preset, what
``xllm model quantize`` writes): ``format: int-quantized``, weights int8, symmetric, per output
channel (``<layer>.weight`` int8 and ``<layer>.weight_scale`` ``[out, 1]``), input activations int8,
symmetric, per token, dynamic; layers matched by ``targets: ["Linear"]`` less ``ignore``. Any other
method or scheme (GPTQ, AWQ, FP8, int4 packs, static or asymmetric activations) is refused by name,
never loaded wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

W8A8_GROUP = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "input_activations": {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    },
}


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization: ``scheme`` ("w8a8") and the layer names it leaves alone."""

    scheme: str
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


def checkpoint_quantization(hf_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization from ``config.json`` (None: a dense checkpoint); ``ValueError``
    naming what is not supported."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported; xllm loads compressed-tensors W8A8 "
            "int8 checkpoints (or quantizes a dense checkpoint itself: --quantization w8a8)"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or not _is_w8a8(groups[0], qc.get("format")):
        raise ValueError(
            "this compressed-tensors scheme is not supported: xllm loads one config group of int8 "
            "weights (symmetric, per channel) with int8 dynamic per-token activations, format "
            f"int-quantized (got format {qc.get('format')!r}, groups {groups})"
        )
    if qc.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not supported")
    return CheckpointQuantization("w8a8", tuple(qc.get("ignore") or ()))


def _is_w8a8(group: dict[str, Any], top_format: str | None) -> bool:
    if (group.get("format") or top_format) != "int-quantized" or group.get("targets") != ["Linear"]:
        return False
    for key, expected in W8A8_GROUP.items():
        spec = group.get(key) or {}
        if any(spec.get(k) != v for k, v in expected.items()):
            return False
        if key == "weights" and (spec.get("dynamic") or spec.get("group_size") not in (None, -1)):
            return False
    return True


def resolve_quantization(requested: str, checkpoint: CheckpointQuantization | None) -> str:
    """The quantization a model runs: the checkpoint's if it has one (``requested`` must be "none" or
    the same), else ``requested``."""
    if checkpoint is None:
        return requested
    if requested not in ("none", checkpoint.scheme):
        raise ValueError(
            f"--quantization {requested} asked for a checkpoint already quantized as {checkpoint.scheme}"
        )
    return checkpoint.scheme


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of a W8A8 checkpoint (what ``checkpoint_quantization`` accepts)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**W8A8_GROUP["weights"], "dynamic": False, "group_size": None},
                "input_activations": W8A8_GROUP["input_activations"],
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
