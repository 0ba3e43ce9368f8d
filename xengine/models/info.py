"""Torch-free model facts read from a HF folder's ``config.json`` (and ``generation_config.json``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from xengine.models.registry import check_architecture


@dataclass
class ModelInfo:
    """What the service, scheduler and KV-cache sizing need to know without loading weights."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # of one token's KV cache entry (MLA: 1, holding the latent and the RoPE key)
    head_dim: int  # likewise (MLA: kv_lora_rank + qk_rope_head_dim)
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    tie_word_embeddings: bool = False


def load_json(path: str) -> dict[str, Any]:
    """Read a JSON object, raising ``ValueError`` with the path on any problem."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """The ``config.json`` of ``model_dir`` as a dict (``ValueError`` if missing or invalid)."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model folder {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} has no config.json; expected a Hugging Face model folder")
    return load_json(path)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a vision-language model: its ``text_config`` (transformers 5)
    over the top-level keys (older flat configs), keeping the top level's ``tie_word_embeddings``;
    a legacy ``mrope`` rope type reads as the default rotary (M-RoPE's sections ride along)."""
    nested = hf.get("text_config")
    if not isinstance(nested, dict):
        return hf
    out = {**hf, **nested}
    out["tie_word_embeddings"] = hf.get("tie_word_embeddings", nested.get("tie_word_embeddings", False))
    for key in ("rope_parameters", "rope_scaling"):
        rope = out.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "mrope":
            out[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default"}
    return out


def hf_architecture(hf: dict[str, Any]) -> str:
    """``architectures[0]`` of a HF config, validated against the registry. ``auto_map`` is ignored."""
    archs = hf.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ValueError("config.json has no 'architectures' list; cannot pick a model implementation")
    check_architecture(archs[0])
    return archs[0]


def hf_head_dim(hf: dict[str, Any]) -> int:
    """``head_dim`` (or NVIDIA's ``attention_head_dim``) from the config, else
    ``hidden_size // num_attention_heads``."""
    dim = hf.get("head_dim") or hf.get("attention_head_dim")
    return int(dim or hf["hidden_size"] // hf["num_attention_heads"])


def hf_num_layers(hf: dict[str, Any]) -> int:
    """``num_hidden_layers``, else the length of the per-layer kind list (transformers writes
    Nemotron-H's config with ``layers_block_type`` only)."""
    if "num_hidden_layers" in hf:
        return int(hf["num_hidden_layers"])
    kinds = hf.get("layers_block_type") or hf.get("layer_types") or hf.get("hybrid_override_pattern")
    if kinds:
        return len(kinds)
    raise ValueError("config.json gives no num_hidden_layers (nor a per-layer kind list)")


def kv_cache_head(hf: dict[str, Any]) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of one token's KV cache entry: for MLA (``kv_lora_rank`` in the
    config) one head holding the latent and the RoPE key, else the attention's own heads."""
    if hf.get("kv_lora_rank"):
        return 1, int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"])
    return int(hf.get("num_key_value_heads") or hf["num_attention_heads"]), hf_head_dim(hf)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def read_model_info(model_dir: str) -> ModelInfo:
    """Read ``ModelInfo`` from ``model_dir``; ``ValueError`` for a missing/invalid config or an
    unsupported architecture. ``eos_token_ids`` is the union of config.json's and
    generation_config.json's ``eos_token_id``."""
    hf = read_hf_config(model_dir)
    arch = hf_architecture(hf)
    hf = text_config(hf)  # a vision-language model: its language model's fields
    eos = _as_id_list(hf.get("eos_token_id"))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        eos += [t for t in _as_id_list(load_json(gen_path).get("eos_token_id")) if t not in eos]
    try:
        return ModelInfo(
            architecture=arch,
            model_type=str(hf.get("model_type", "")),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_layers=hf_num_layers(hf),
            num_heads=int(hf["num_attention_heads"]),
            num_kv_heads=kv_cache_head(hf)[0],
            head_dim=kv_cache_head(hf)[1],
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            eos_token_ids=eos,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ValueError(f"{model_dir}/config.json lacks required field {e.args[0]!r}") from e
