"""Quantized checkpoints: what a ``quantization_config`` asks for, and which linear layers it covers.

Each method's reader (``xengine/models/quant_formats/``) turns its config into a
``CheckpointQuantization`` and its tensors into the canonical form the engine packs
(``quant_formats/canonical.py``). Loaded: compressed-tensors W8A8 int8, W8A16 int8 (int- or
pack-quantized), int4 pack-quantized (groups or channels, symmetric or not) and FP8 e4m3 per channel
with dynamic per-token activations (the FP8_DYNAMIC preset); GPTQ 4-bit (v1 and v2 zero points,
activation order only where ``g_idx`` is trivial); AWQ 4-bit GEMM. Anything else (other bits,
block-wise FP8, static activations, KV-cache schemes, ...) is refused with the config field that
differs, never loaded wrong.
"""

from __future__ import annotations

from typing import Any

from xengine.models.quant_formats import awq, compressed, gptq
from xengine.models.quant_formats.checkpoint import METHODS, CheckpointQuantization

__all__ = ["CheckpointQuantization", "checkpoint_quantization", "quantization_config", "resolve_quantization"]
READERS = {"compressed-tensors": compressed, "gptq": gptq, "awq": awq}


def checkpoint_quantization(hf_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization from ``config.json`` (None: a dense checkpoint); ``ValueError``
    naming the ``quantization_config`` field that xllm does not support."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError("config.json quantization_config must be an object")
    method = qc.get("quant_method")
    reader = READERS.get(method)
    if reader is None:
        hint = " (block-wise FP8: weight_block_size)" if "weight_block_size" in qc else ""
        raise ValueError(
            f"quantization_config.quant_method {method!r}{hint} is not supported; xllm loads "
            f"{', '.join(METHODS)} checkpoints (or quantizes a dense checkpoint itself: --quantization)"
        )
    return reader.parse(qc)


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
    """The ``quantization_config`` of a compressed-tensors W8A8 checkpoint (what
    ``checkpoint_quantization`` accepts)."""
    return compressed.write_config("w8a8", -1, ignore)
