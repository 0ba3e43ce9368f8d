"""Packed linear weights (oneDNN on CPU) compute what ``F.linear`` computes, eager and compiled."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from ops import linear as linear_ops
from xengine.layers.linear import Linear, MergedLinear, pack_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    x = torch.randn(2, rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    assert layer._packed is not None
    out = layer(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    """Each row comes out bit for bit the same whatever rows share its call: a prefix-cache hit (one
    row) then computes what the miss (the whole prompt) did, and a sequence's tokens do not depend on
    its batch. (MKL's F.linear does not hold this: its one-row gemv rounds differently from its gemm.)"""
    torch.manual_seed(3)
    layer = Linear(96, 160, bias=True)
    layer.pack()
    if layer._packed is None:
        pytest.skip("no packed form on this platform")
    x = torch.randn(300, 96)
    whole = layer(x)
    for rows in (1, 2, 7, 64):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows


def test_half_weights_stay_unpacked() -> None:
    """float16 has no packed CPU form (bfloat16 does where the CPU has bf16 units:
    ``test_panel_gemm_bf16.py``)."""
    layer = Linear(32, 32, bias=False).to(torch.float16)
    layer.pack()
    assert layer._packed is None
    x = torch.randn(3, 32, dtype=torch.float16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_pack_linears_counts_and_compiles() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(MergedLinear(16, [8, 24], bias=False), torch.nn.SiLU(), Linear(32, 4))
    x = torch.randn(5, 16)
    expected = model(x)
    packed = pack_linears(model)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    assert packed == 2
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


def test_dropped_layer_frees_its_packed_weight() -> None:
    layer = Linear(64, 64)
    layer.pack()
    if layer._packed is None:
        pytest.skip("no packed form on this platform")
    handle = layer._packed
    assert handle in linear_ops._PACKED
    del layer
    gc.collect()
    assert handle not in linear_ops._PACKED
