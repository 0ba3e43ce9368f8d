"""RMSNorm (plain and fused with the residual add) vs HF; SwiGLU gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ops.activation import silu_and_mul
from ops.norm import fused_add_rms_norm, rms_norm


def _hf_norm(weight: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps)
    norm.weight.data.copy_(weight)
    return norm.to(weight.dtype)


def test_rms_norm_matches_hf() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=gen) * 3, torch.randn(64, generator=gen)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), _hf_norm(w, 1e-5)(x))


def test_rms_norm_bfloat16_matches_hf() -> None:
    x, w = torch.randn(3, 32).bfloat16(), torch.randn(32).bfloat16()
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _hf_norm(w, 1e-6)(x))


def test_fused_add_rms_norm_returns_norm_and_new_residual() -> None:
    x, residual, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    out, new_residual = fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-6)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, _hf_norm(w, 1e-6)(x + residual))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 2, 10)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[..., :5]) * x[..., 5:])
    assert silu_and_mul(x).shape == (3, 2, 5)
