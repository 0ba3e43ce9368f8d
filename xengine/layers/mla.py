"""Multi-head latent attention (DeepSeek-V2/V3) over the compressed latent KV cache.

Each token caches one vector per layer: its normalised KV latent (``kv_lora_rank``) followed by its
rotated shared RoPE key (``qk_rope_head_dim``), stored as a single KV head of that width, so the paged
and xTensor layouts, the prefix cache and KV transfer handle it like any other cache. Attention runs
in the latent space (the "absorbed" form): each head's no-RoPE query is multiplied into the latent by
its slice of ``kv_b_proj`` (``W_UK``), scores are ``q_latent . c + q_rope . k_rope``, and the output
latent is expanded per head by ``W_UV`` before ``o_proj``. That equals HF's form, which expands every
cached latent into per-head keys and values, up to float rounding.

The cache holds the vector twice (as K and as V, the attention op's layout): the latent read as V is
the first ``kv_lora_rank`` dims of K. A dedicated MLA attention op reading V from K would halve it.
"""

from __future__ import annotations

import torch
from torch import nn

from graph.attention_op import unified_attention
from xengine.layers.linear import Linear
from xengine.layers.norm import RMSNorm
from xengine.layers.parallel_linear import column_single, row_linear
from xengine.layers.rotary import RotaryEmbedding
from xengine.parallel.tensor import split_evenly, tp_rank_size

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MultiLatentAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        bias: bool,
        rotary: RotaryEmbedding,
        layer_idx: int,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # its KV cache in the forward context
        # tensor parallel: this rank's heads; the latent (the cache, its projections) is every rank's
        _, size = tp_rank_size()
        full_heads, num_heads = num_heads, split_evenly(num_heads, size, "number of attention heads")
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        q_size = full_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = column_single(hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = column_single(q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        # never run as a layer: its weight is read per head (W_UK, W_UV), so plain nn.Linear (not packed)
        kv_b_size = full_heads * (qk_nope_head_dim + v_head_dim)
        self.kv_b_proj = column_single(kv_lora_rank, kv_b_size, bias=False, cls=nn.Linear)
        self.o_proj = row_linear(full_heads * v_head_dim, hidden_size, bias=bias)
        self.rotary = rotary
        self.scale = scale

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self._query(x).view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary(positions, q_rope.contiguous(), k_rope.reshape(num_tokens, 1, -1))
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        w_uk, w_uv = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat([q_latent, q_rope], dim=-1)
        kv = torch.cat([latent, k_rope.reshape(num_tokens, -1)], dim=-1).unsqueeze(1)
        out = unified_attention(query, kv, kv, self.layer_idx, self.scale, None)
        out = torch.einsum("thl,hvl->thv", out[..., : self.kv_lora_rank], w_uv)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))
