"""Builders shared by the model tests: tiny random HF checkpoints of every supported architecture
variant, and a paged KV cache that drives models through hand-built ``AttentionMetadata``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from ops.attention import AttentionMetadata, build_attention_metadata
from xengine.tools.make_tiny import randomise_gemma_norms

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    max_position_embeddings=256,
)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}  # fmt: skip
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# name -> (config class name, extra config kwargs)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 16, "rope_theta": 1000.0}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "llama": ("LlamaConfig", {}),
    "llama_llama3": ("LlamaConfig", {"rope_scaling": _LLAMA3, "rope_theta": 500000.0}),
    "llama_linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen3_yarn": ("Qwen3Config", {"head_dim": 16, "rope_scaling": _YARN}),
    "mistral_window": ("MistralConfig", {"sliding_window": 6, "head_dim": 16}),
    "qwen2_window": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    # a sliding-window layer then a global one, each with its own RoPE (linear scaling on the global)
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "tie_word_embeddings": False,
        },
    ),
}


def build_checkpoint(name: str, out: Path) -> Path:
    """Write the seeded random checkpoint ``name`` of ``VARIANTS`` to ``out`` (safetensors)."""
    import transformers

    cls_name, extra = VARIANTS[name]
    cfg = getattr(transformers, cls_name)(**_COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    randomise_gemma_norms(model, seed=0)
    model.save_pretrained(out, safe_serialization=True)
    return out


class PagedKV:
    """Per-layer KV caches plus block tables grown on demand from a shuffled free list, so sequences
    own non-contiguous, interleaved blocks like under a real block pool."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:  # fmt: skip
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(num_layers)]
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def step(self, seq_ids: list[int], query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        """Metadata for one step where sequence ``seq_ids[i]`` adds ``query_lens[i]`` tokens, reaching
        ``seq_lens[i]``. NaN-initialised caches make any read of an unwritten slot visible."""
        tables = []
        for seq_id, seq_len in zip(seq_ids, seq_lens):
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < seq_len:
                table.append(self.free.pop())
            tables.append(table)
        return build_attention_metadata(query_lens, seq_lens, tables, self.block_size)
