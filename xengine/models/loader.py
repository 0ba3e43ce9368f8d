"""Load a local HF-format model folder (``config.json`` + ``*.safetensors``) into a ``BaseCausalLM``.

Only safetensors are read (no pickle); ``auto_map`` / remote code is never honoured: the class comes
from our registry by ``architectures[0]``.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from ops.platforms import Platform
from xengine.layers.checkpoint_tensor import LazyTensor
from xengine.layers.linear import pack_linears
from xengine.layers.moe import FusedExperts
from xengine.models.base import BaseCausalLM
from xengine.models.info import hf_architecture, load_json, read_hf_config
from xengine.models.quantization import checkpoint_quantization, resolve_quantization
from xengine.models.quantized_weights import (
    attach_quant_params,
    canonical_weights,
    pack_quantized_linears,
)
from xengine.models.registry import get_model_class
from xengine.parallel.state import get_expert_parallel
from xengine.parallel.tensor import tp_rank_size

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files of ``model_dir`` (from the shard index if present), else ``ValueError``."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = load_json(index_path).get("weight_map") or {}
        files = sorted({os.path.join(model_dir, f) for f in weight_map.values()})
        absent = [f for f in files if not os.path.isfile(f)]
        if not files or absent:
            raise ValueError(
                f"{_INDEX_FILE} in {model_dir!r} lists missing shards: {absent or 'none listed'}"
            )
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    if any(name.endswith(_PICKLE_SUFFIXES) for name in os.listdir(model_dir)):
        raise ValueError(
            f"{model_dir!r} only has pickle checkpoints (.bin/.pt/.pth), which are never loaded for safety; "
            "convert them to safetensors first (e.g. load with transformers and "
            "save_pretrained(..., safe_serialization=True))"
        )
    raise ValueError(f"{model_dir!r} has no *.safetensors weights")


def iterate_weights(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``files`` (CPU tensors, checkpoint dtype);
    ``lazy``: a ``LazyTensor`` each, read (in part) by the layer that loads it."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (LazyTensor(name, f) if lazy else f.get_tensor(name))


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    pack: bool = True,
) -> BaseCausalLM:
    """Build the registered model for ``model_dir`` in ``dtype`` on ``device`` and load its weights;
    ``quantization`` ("none" | "w8a8" | "int8" | "int4" | "fp8") quantizes its linear layers as they
    are packed. A checkpoint quantized already (``quantization_config``:
    ``xengine/models/quantization.py``) is packed from its own values, scales and zero points.
    ``pack=False`` leaves every layer unpacked (the canonical tensors as loaded). Returns it in eval
    mode with gradients disabled."""
    hf_config = read_hf_config(model_dir)
    cls = get_model_class(hf_architecture(hf_config))
    files = safetensors_files(model_dir)
    stored = checkpoint_quantization(hf_config)
    quantization = resolve_quantization(quantization, stored)
    _, tp_size = tp_rank_size()
    if tp_size > 1:
        check_tensor_parallel(cls, stored is not None)
    # Build on the meta device (no random init, no memory), then allocate directly on the target.
    with torch.device("meta"):
        model = cls.from_hf_config(hf_config)
    model = model.to(dtype=dtype).to_empty(device=device)
    # a parallel rank reads only its shards (its heads, columns, experts) of each checkpoint tensor
    weights = iterate_weights(
        files, lazy=stored is None and (tp_size > 1 or get_expert_parallel() is not None)
    )
    if stored is not None:
        weights = canonical_weights(weights, stored, attach_quant_params(model, stored))
    model.load_weights(weights)
    model.eval()
    model.requires_grad_(False)
    if pack and stored is not None:
        pack_quantized_linears(model, quantization)
    elif pack:
        pack_linears(model, quantization)  # the platform's faster GEMM layout, where it has one
    _warn_unquantized_experts(model, quantization)
    return model


def check_tensor_parallel(cls: type, quantized_checkpoint: bool) -> None:
    """Refuse, before any weight is read, a model that cannot split over a tensor-parallel group."""
    if not getattr(cls, "tensor_parallel", False):
        raise ValueError(
            f"{cls.__name__} does not support tensor_parallel_size > 1 yet; models that do: "
            "Qwen3ForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, "
            "MistralForCausalLM, Gemma3ForCausalLM"
        )
    if quantized_checkpoint:
        raise ValueError(
            "a pre-quantized checkpoint cannot load with tensor_parallel_size > 1 yet; load the float "
            "checkpoint (optionally with --quantization, which quantizes each rank's shard)"
        )


def _warn_unquantized_experts(model: BaseCausalLM, quantization: str) -> None:
    """Quantization covers the linear layers; MoE experts (one fused tensor per layer) keep the
    model's dtype. Say so, with their share of the weights, rather than let a user believe otherwise."""
    if quantization == "none":
        return
    experts = sum(p.numel() for m in model.modules() if isinstance(m, FusedExperts) for p in m.parameters())
    if experts:
        total = sum(p.numel() for p in model.parameters())
        logger.warning(
            "--quantization %s covers the linear layers only: the MoE experts (%.0f%% of the weights) stay "
            "in the model's dtype",
            quantization,
            100.0 * experts / max(total, 1),
        )


def resolve_dtype(platform: Platform, requested: str, checkpoint: str | None) -> torch.dtype:
    """``model.dtype`` ("auto": the checkpoint's ``torch_dtype``) as the platform runs it."""
    name = requested if requested != "auto" else (checkpoint or "float32")
    dtype = _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
    return platform.default_dtype_for(dtype)
