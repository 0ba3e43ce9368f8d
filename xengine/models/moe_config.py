"""Torch-free parsed config of a decoder whose feed-forward layers are (partly) sparse MoE blocks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from xengine.models.decoder_config import DecoderConfig


@dataclass(frozen=True)
class MoeDecoderConfig(DecoderConfig):
    # defaults only so that subclasses may add fields; ``moe_config_from_hf`` sets every one
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE block (True) or the dense MLP


def parse_sparse_layers(hf: dict[str, Any], num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """HF's rule (Qwen2/3-MoE): layer ``i`` is sparse unless it is in ``mlp_only_layers``, and only when
    ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def moe_config_from_hf(base: DecoderConfig, hf: dict[str, Any]) -> MoeDecoderConfig:
    """Extend the dense ``base`` config with the MoE fields of the HF config dict ``hf``
    (``num_experts``, or ``num_local_experts`` as newer ``transformers`` writes it)."""
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts")) or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    if num_experts and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
    return MoeDecoderConfig(
        **{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=parse_sparse_layers(hf, base.num_layers, num_experts),
    )
