"""``QuantizedLinear``: what every quantized linear layer of every backend shares.

The shape, the bias (float32, added to float32 sums), ``float_output``, and the call on ``x [..., in]``:
flattened to rows, an empty batch answered without a kernel, the result viewed back to ``x``'s leading
dims in ``x``'s dtype (float32 with ``float_output``). A layer states only how it multiplies rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.quant.weights import LinearWeights


class QuantizedLinear:
    """Base of the quantized layers, built from the ``LinearWeights`` the facade passes: subclasses
    implement ``forward_rows`` (and ``dequantized_weight`` for their tests and fallbacks)."""

    def __init__(self, weights: LinearWeights) -> None:
        self.out_features, self.in_features = weights.weight.shape
        bias = weights.bias
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.float_output = weights.float_output

    def output_dtype(self, x: torch.Tensor) -> torch.dtype:
        """float32 with ``float_output``, else ``x``'s dtype."""
        return torch.float32 if self.float_output else x.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.output_dtype(x)
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features, dtype=out_dtype)
        out = self.forward_rows(flat, out_dtype).to(out_dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def forward_rows(self, flat: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``flat [m, in]`` (m > 0) times the weight plus the bias, ``[m, out]`` (converted to
        ``out_dtype`` after, where it is not already)."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer multiplies by, ``[out, in]`` float32."""
        raise NotImplementedError

    def dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times ``dequantized_weight()`` in float32, in the output dtype: the reference of the
        weight-only schemes and the kernels' fallback for inputs they do not take."""
        return F.linear(x.float(), self.dequantized_weight(), self.bias).to(self.output_dtype(x))
