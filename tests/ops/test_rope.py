"""RoPE cos/sin caches and rotation vs HF transformers' rotary embedding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ops.rope import build_cos_sin_cache, rotary_embedding
from ops.rope_scaling import compute_inv_freq, max_context_len

HEAD_DIM, MAX_POS = 32, 128
VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },  # fmt: skip
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },  # fmt: skip
    "yarn_legacy_type_key": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
}


def _hf_config(scaling: dict | None) -> LlamaConfig:
    params = {"rope_type": "default"} if scaling is None else dict(scaling)
    params["rope_theta"] = 10000.0
    return LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, max_position_embeddings=MAX_POS,
                       rope_parameters=params)  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_rotation_matches_hf(name: str) -> None:
    scaling = VARIANTS[name]
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 31, 32, 77, MAX_POS - 1])
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=gen)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=gen)
    cache = build_cos_sin_cache(HEAD_DIM, MAX_POS, 10000.0, scaling)
    q_out, k_out = rotary_embedding(positions, q, k, cache)

    hf_rope = LlamaRotaryEmbedding(_hf_config(scaling))
    cos, sin = hf_rope(q, positions[None])  # [1, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_dynamic_ntk_matches_hf_at_full_length() -> None:
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    ours, factor = compute_inv_freq(HEAD_DIM, 10000.0, scaling, MAX_POS)
    ref, ref_factor = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(scaling), seq_len=MAX_POS * 2)
    torch.testing.assert_close(ours, ref)
    assert factor == ref_factor == 1.0
    assert build_cos_sin_cache(HEAD_DIM, MAX_POS, 10000.0, scaling).shape == (2 * MAX_POS, HEAD_DIM)


def test_gptj_interleaved_matches_complex_rotation() -> None:
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([3, 0, 9])
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    cache = build_cos_sin_cache(8, 16, 10000.0)
    q_out, _ = rotary_embedding(positions, q, k, cache, is_neox=False)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    angle = positions[:, None].float() * inv_freq  # [T, 4]
    rotated = (
        torch.view_as_complex(q.reshape(3, 2, 4, 2).contiguous())
        * torch.polar(torch.ones_like(angle), angle)[:, None]
    )
    torch.testing.assert_close(q_out, torch.view_as_real(rotated).reshape(3, 2, 8))


def test_partial_rotary_leaves_tail_untouched_and_keeps_dtype() -> None:
    q = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    cache = build_cos_sin_cache(8, 32, 10000.0)
    q_out, k_out = rotary_embedding(torch.arange(4), q, q[:, :1], cache)
    assert q_out.dtype == torch.bfloat16 and k_out.shape == (4, 1, 16)
    assert torch.equal(q_out[..., 8:], q[..., 8:])
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="longrope"):
        build_cos_sin_cache(8, 16, 10000.0, {"rope_type": "longrope"})


@pytest.mark.parametrize(
    "name, expected",
    [
        ("default", MAX_POS),
        ("linear", 4 * MAX_POS),
        ("llama3", 8 * 32),
        ("yarn", MAX_POS),
        ("yarn_mscale", MAX_POS),
    ],
)
def test_max_context_len(name: str, expected: int) -> None:
    assert max_context_len(MAX_POS, VARIANTS[name]) == expected


def test_dynamic_ntk_supports_any_length() -> None:
    assert max_context_len(MAX_POS, {"rope_type": "dynamic", "factor": 2.0}) is None


@pytest.mark.parametrize("name", ["default", "linear", "yarn"])
def test_cache_covers_max_len_and_matches_hf_past_max_position(name: str) -> None:
    scaling = VARIANTS[name]
    max_len = max(max_context_len(MAX_POS, scaling), 3 * MAX_POS)  # an engine's long max_model_len
    cache = build_cos_sin_cache(HEAD_DIM, MAX_POS, 10000.0, scaling, max_len=max_len)
    assert cache.shape == (max_len, HEAD_DIM)
    positions = torch.tensor([0, MAX_POS - 1, MAX_POS, max_len - 1])
    q = torch.randn(len(positions), 2, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    q_out, _ = rotary_embedding(positions, q, q.clone(), cache)
    cos, sin = LlamaRotaryEmbedding(_hf_config(scaling))(q, positions[None])
    hf_q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_dynamic_ntk_sized_for_a_longer_max_len_matches_hf_there() -> None:
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    ours, _ = compute_inv_freq(HEAD_DIM, 10000.0, scaling, MAX_POS, max_len=5 * MAX_POS)
    ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(scaling), seq_len=5 * MAX_POS)
    torch.testing.assert_close(ours, ref)
    cache = build_cos_sin_cache(HEAD_DIM, MAX_POS, 10000.0, scaling, max_len=5 * MAX_POS)
    assert cache.shape == (5 * MAX_POS, HEAD_DIM)
