"""A model loaded with ``quantization="w8a8"`` computes what the same model computes with every linear
layer but the LM head replaced by the torch reference of the W8A8 arithmetic
(``ops/cpu_kernels/linear_int8.reference_w8a8``): the kernel is checked inside the whole forward,
through prefill and decode, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.cpu_kernels.linear_int8 import PanelLinearInt8, reference_w8a8
from tests.xengine.models.helpers import PagedKV
from xengine.layers.linear import Linear
from xengine.models.loader import load_model

pytestmark = pytest.mark.skipif(
    kernel_library("panel_gemm_int8") is None,
    reason=f"int8 panel GEMM unavailable here: {unavailable_reason('panel_gemm_int8')}",
)


def _reference_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The unquantized model with each non-LM-head linear computing ``reference_w8a8``."""
    model = load_model(path, dtype, torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, Linear) and not module.float_output:
            module._packed = None  # F.linear path, then replaced below
            module.forward = lambda x, m=module: reference_w8a8(x, m.weight, m.bias).to(x.dtype)
    return model


@torch.no_grad()
def _logits(model: torch.nn.Module, dtype: torch.dtype, tokens: list[int], decode: int) -> torch.Tensor:
    """Logits of a prefill of ``tokens`` then ``decode`` greedy decode steps, stacked per position."""
    cfg = model.config
    kv = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    out, seq = [], list(tokens)
    new = list(tokens)
    for _ in range(decode + 1):
        meta = kv.step([0], [len(new)], [len(seq)])
        ids = torch.tensor(new, dtype=torch.int64)
        pos = torch.arange(len(seq) - len(new), len(seq), dtype=torch.int64)
        logits = model.compute_logits(model(ids, pos, kv.caches, meta))
        out.append(logits)
        new = [int(logits[-1].argmax())]
        seq += new
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_model_matches_the_reference_arithmetic(checkpoint, dtype: torch.dtype) -> None:
    path = str(checkpoint("qwen3"))
    ours = load_model(path, dtype, torch.device("cpu"), "w8a8")
    quantized = [
        m for m in ours.modules() if isinstance(m, Linear) and isinstance(m._packed_owner, PanelLinearInt8)
    ]
    assert quantized and not isinstance(ours.lm_head._packed_owner, PanelLinearInt8)
    tokens = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    got = _logits(ours, dtype, tokens, decode=6)
    ref = _logits(_reference_model(path, dtype), dtype, tokens, decode=6)
    scale = ref.abs().max().item()
    # same integer sums; fp32 (bf16) rounding of scales and activations may move an activation across
    # a quantization step now and then, which moves a logit by a fraction of a percent
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert (got - ref).abs().max().item() <= tol * scale
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
