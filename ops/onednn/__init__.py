"""oneDNN (mkldnn) CPU backend: linear layers with weights reordered once into oneDNN's blocked layout.

On the CPUs this project runs on, ``torch.ops.mkldnn._linear_pointwise`` over a reordered fp32 weight
runs about twice as fast as ``F.linear`` (MKL sgemm) for decode-sized and prefill-sized inputs alike
(``benchmarks/linear_gemm.py``). Other dtypes keep ``F.linear``, and so do small weights: each call
of the oneDNN op costs ~30-40 µs before any arithmetic (an AVX2 EPYC, one thread), where MKL's
sgemm behind ``F.linear`` costs ~7, and up to ``SMALL_WEIGHT_ELEMENTS`` MKL was as fast or faster at
every row count measured (1 to 2048). A single row goes to ``F.linear`` on the caller's weight too:
MKL's gemv streams a weight from memory at about the read bandwidth, oneDNN at about two thirds of it
(``benchmarks/linear_gemm.py``'s model sweep: 8.7 against 13.5 ms for the small checkpoint's
projections at one token), while from two rows on oneDNN is as fast or faster. ``ops/cpu_kernels``
uses it where its panel kernel cannot run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# weights of at most this many elements stay on F.linear (MKL): oneDNN's fixed per-call cost dominates
SMALL_WEIGHT_ELEMENTS = 256 * 1024


class OneDNNLinear:
    """A weight reordered for oneDNN (and its bias); call it on ``x [..., in]``. ``weight`` itself is
    kept (a reference: the layer owns it) for single rows, which MKL's gemv runs faster."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.plain = weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 1:
            out = F.linear(flat, self.plain, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, float_output: bool = False
) -> OneDNNLinear | None:
    """oneDNN's packed form of a float32 weight (``float_output``: float32 inputs give float32 anyway);
    None (``F.linear``) for other dtypes and for weights of at most ``SMALL_WEIGHT_ELEMENTS``."""
    if (
        weight.dtype != torch.float32
        or weight.numel() <= SMALL_WEIGHT_ELEMENTS
        or weight.device.type != "cpu"
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    return OneDNNLinear(weight, bias)
