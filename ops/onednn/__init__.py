"""oneDNN (mkldnn) CPU backend: linear layers with weights reordered once into oneDNN's blocked layout.

On the CPUs this project runs on, ``torch.ops.mkldnn._linear_pointwise`` over a reordered fp32 weight
runs about twice as fast as ``F.linear`` (MKL sgemm) for decode-sized and prefill-sized inputs alike
(``benchmarks/linear_gemm.py``). Other dtypes keep ``F.linear``. ``ops/cpu_kernels`` uses it where its
panel kernel cannot run.
"""

from __future__ import annotations

import torch


class OneDNNLinear:
    """A weight reordered for oneDNN (and its bias); call it on ``x [..., in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, float_output: bool = False
) -> OneDNNLinear | None:
    """oneDNN's packed form of a float32 weight (``float_output``: float32 inputs give float32 anyway)."""
    if (
        weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    return OneDNNLinear(weight, bias)
