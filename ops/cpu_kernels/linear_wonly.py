"""Weight-only int8 and int4 linear layers on the weight-only panel GEMM (``panel_gemm_wonly.h``).

Decode steps stream every weight once, so their time follows the weights' bytes: int8 weights are a
quarter of float32's, int4 an eighth. The weights stay packed in 32-column panels of k pairs and are
dequantized a chunk at a time, to exact integers, in a buffer that stays in L1; the products run on
float32 FMAs for float32 ``x`` (``panel_gemm_wonly.c``: ``x`` unrounded) and on the bf16 dot-product unit
for bfloat16 ``x`` where the CPU has one (``panel_gemm_wonly_bf16.c``: twice the FMA rate), with the
per-channel (int8) or per-group (int4) scales applied to the float32 sums. The rounding of the weights
is ``ops/quant/int8.py`` / ``ops/quant/int4.py``'s, and ``ReferenceInt8Linear`` /
``ReferenceInt4Linear`` there are the oracle.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ops.cpu_kernels.mixed_gemm import mixed_gemm
from ops.quant.int4 import dequantize_int4, int4_weight
from ops.quant.int8 import int8_weight
from ops.quant.layer import QuantizedLinear
from ops.quant.weights import LinearWeights

PANEL_COLUMNS = 32


def _panel_rows(t: torch.Tensor, fill: float) -> torch.Tensor:
    """``t [out, ...]`` padded with ``fill`` to whole panels of rows."""
    pad = -t.shape[0] % PANEL_COLUMNS
    return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)]) if pad else t


def pack_int8_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[out, in]`` -> panels ``[ceil(out / 32)][ceil(in / 2)][32][2]`` (zero padded)."""
    n, k = q.shape
    padded = F.pad(_panel_rows(q, 0), (0, k % 2))
    panels, pairs = padded.shape[0] // PANEL_COLUMNS, padded.shape[1] // 2
    return padded.view(panels, PANEL_COLUMNS, pairs, 2).permute(0, 2, 1, 3).contiguous().view(torch.uint8)


def pack_int4_panels(q: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[out, in]`` (uint8 in [0, 15]) -> panels ``[ceil(out / 32)][ceil(in / 2)][32]`` bytes:
    even k in the low nibble, odd k in the high one (zero padded)."""
    n, k = q.shape
    padded = F.pad(_panel_rows(q, 0), (0, k % 2))
    pairs = padded[:, 0::2] | (padded[:, 1::2] << 4)
    panels = pairs.shape[0] // PANEL_COLUMNS
    return pairs.view(panels, PANEL_COLUMNS, -1).permute(0, 2, 1).contiguous()


def unpack_int8_panels(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``pack_int8_panels``'s inverse: the int8 codes ``[n, k]``."""
    pairs = -(-k // 2)
    q = packed.view(torch.int8).view(-1, pairs, PANEL_COLUMNS, 2).permute(0, 2, 1, 3)
    return q.reshape(-1, 2 * pairs)[:n, :k]


def unpack_int4_panels(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``pack_int4_panels``'s inverse: the codes ``[n, k]`` (uint8 in [0, 15])."""
    pairs = packed.view(-1, -(-k // 2), PANEL_COLUMNS).permute(0, 2, 1).reshape(-1, -(-k // 2))
    return torch.stack([pairs & 15, pairs >> 4], dim=-1).view(pairs.shape[0], -1)[:n, :k]


def _group_panels(t: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """Per-(channel, group) values ``[out, groups]`` -> ``[ceil(out / 32)][groups][32]``."""
    padded = _panel_rows(t, fill)
    return padded.view(-1, PANEL_COLUMNS, t.shape[1]).permute(0, 2, 1).contiguous().to(dtype)


class PanelLinearWeightOnly(QuantizedLinear):
    """A weight quantized to int8 (per output channel) or int4 (per group) and packed for the
    weight-only panel GEMM; call it on ``x [..., in]`` (float32 or bfloat16: the output has its dtype,
    or float32 with ``float_output``; other dtypes run ``F.linear`` on the dequantized weight).
    ``weights.quantization`` "int8" or "int4"; with ``weights.scale`` (and for int4 ``zero``), ``weight``
    holds a quantized checkpoint's codes (``ops/linear.py`` has the layouts), packed as they are.
    ``libs``: ``(float32 kernel, bf16 kernel or None)``."""

    def __init__(self, weights: LinearWeights, libs: tuple[ctypes.CDLL, ctypes.CDLL | None]) -> None:
        super().__init__(weights)
        self.bits = bits = 8 if weights.quantization == "int8" else 4
        if bits == 8:
            q, scale = int8_weight(weights)
            self.weight_scale, self.weight_zero = scale, None
            self.group_size, self.num_groups = 2 * -(-self.in_features // 2), 1
            self.packed = pack_int8_panels(q)
            self.scales = _group_panels(scale[:, None], 1.0, torch.float32)
            self.zeros = None
        else:
            q, scale, zero, self.group_size = int4_weight(weights.weight, weights.scale, weights.zero)
            if self.group_size % 2:
                raise ValueError(
                    f"int4 groups of {self.group_size} inputs: the CPU kernel needs an even size"
                )
            self.weight_scale, self.weight_zero = scale, zero
            self.num_groups = scale.shape[1]
            self.packed = pack_int4_panels(q)
            self.scales = _group_panels(scale, 1.0, torch.float32)
            self.zeros = _group_panels(zero, 0.0, torch.int32)
        self._f32, self._bf16 = (
            libs[0].xllm_wonly_gemm_f32,
            None if libs[1] is None else libs[1].xllm_wonly_gemm_bf16,
        )
        self._args = (
            self.packed.data_ptr(), bits, self.scales.data_ptr(),
            None if self.zeros is None else self.zeros.data_ptr(), self.group_size, self.num_groups,
            self.out_features, None if self.bias is None else self.bias.data_ptr(),
        )  # fmt: skip

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by, ``[out, in]`` float32 (for the fallback and tests)."""
        n, k = self.out_features, self.in_features
        if self.bits == 8:
            return unpack_int8_panels(self.packed, n, k).float() * self.weight_scale[:, None]
        q = unpack_int4_panels(self.packed, n, k)
        return dequantize_int4(q, self.weight_scale, self.weight_zero, self.group_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0 or x.dtype not in (torch.float32, torch.bfloat16):
            return self.dequantized_linear(x)
        gemm = self._bf16 if x.dtype == torch.bfloat16 and self._bf16 is not None else self._f32
        return mixed_gemm(
            x, self.out_features, self.float_output,
            lambda flat, rows, x16, out, o16: gemm(
                flat, x16, rows, self.in_features, *self._args, out, o16, torch.get_num_threads(),
            ),
        )  # fmt: skip
