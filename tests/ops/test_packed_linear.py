"""Packed linear weights (oneDNN on CPU) compute what ``F.linear`` computes, eager and compiled.

The layers here are small; oneDNN leaves weights that small to ``F.linear`` (``SMALL_WEIGHT_ELEMENTS``),
so the tests that check the packed arithmetic lower that bound to pack them anyway."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import ops.onednn
from ops import linear as linear_ops
from xengine.layers.linear import Linear, MergedLinear, pack_linears


@pytest.fixture
def pack_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops.onednn, "SMALL_WEIGHT_ELEMENTS", 0)


def test_small_weights_stay_on_f_linear() -> None:
    """oneDNN's call costs more than MKL's whole GEMM up to SMALL_WEIGHT_ELEMENTS: those stay on F.linear."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    small = torch.randn(ops.onednn.SMALL_WEIGHT_ELEMENTS // 128, 128)
    large = torch.randn(ops.onednn.SMALL_WEIGHT_ELEMENTS // 128 + 1, 128)
    assert ops.onednn.pack_linear(small, None) is None
    packed = ops.onednn.pack_linear(large, None)
    assert packed is not None
    x = torch.randn(3, 128)
    torch.testing.assert_close(packed(x), F.linear(x, large), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_matches_f_linear(pack_small: None, rows: int, bias: bool) -> None:
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


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_matches_f_linear(pack_small: None, bias: bool) -> None:
    """A single row runs MKL's gemv on the layer's own weight, more rows oneDNN's packed copy."""
    torch.manual_seed(2)
    layer = Linear(96, 160, bias=bias)
    layer.pack()
    if layer._packed is None:
        pytest.skip("no packed form on this platform")
    for shape in [(1, 96), (1, 1, 96), (2, 96)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_half_weights_stay_unpacked() -> None:
    """float16 has no packed CPU form (bfloat16 does where the CPU has bf16 units:
    ``test_panel_gemm_bf16.py``)."""
    layer = Linear(32, 32, bias=False).to(torch.float16)
    layer.pack()
    assert layer._packed is None
    x = torch.randn(3, 32, dtype=torch.float16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_pack_linears_counts_and_compiles(pack_small: None) -> None:
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


def test_dropped_layer_frees_its_packed_weight(pack_small: None) -> None:
    layer = Linear(64, 64)
    layer.pack()
    if layer._packed is None:
        pytest.skip("no packed form on this platform")
    handle = layer._packed
    assert handle in linear_ops._PACKED
    del layer
    gc.collect()
    assert handle not in linear_ops._PACKED
