"""--quantization on an MoE model: the linear layers are quantized, the fused experts are not, and the
loader says so (with their share of the weights) instead of leaving a user to believe otherwise."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from xengine.layers.linear import Linear
from xengine.layers.moe import FusedExperts
from xengine.models.loader import load_model


def test_quantizing_an_moe_model_warns_that_experts_keep_their_dtype(
    make_model_dir: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = make_model_dir("qwen3_moe")
    with caplog.at_level(logging.WARNING, logger="xengine.models.loader"):
        model = load_model(str(model_dir), torch.float32, torch.device("cpu"), "int8")
    assert any(isinstance(m, Linear) and m._packed is not None for m in model.modules())
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(p.dtype == torch.float32 for m in experts for p in m.parameters())
    warnings = [r.getMessage() for r in caplog.records if "MoE experts" in r.getMessage()]
    assert len(warnings) == 1 and "int8" in warnings[0] and "% of the weights" in warnings[0]


def test_a_dense_model_or_no_quantization_warns_nothing(
    make_model_dir: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="xengine.models.loader"):
        load_model(str(make_model_dir("qwen3_moe")), torch.float32, torch.device("cpu"))
        load_model(str(make_model_dir("qwen3")), torch.float32, torch.device("cpu"), "int8")
    assert not [r for r in caplog.records if "MoE experts" in r.getMessage()]
