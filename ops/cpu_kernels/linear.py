"""Linear layers on the panel GEMM (``panel_gemm.c``), for every row count.

Decode steps multiply a few rows (the batch) by every weight of the model, so they stream all the
weights from memory each step. oneDNN and MKL take about the memory time plus the FMA time there (the
next weight block is not loaded while the current one is multiplied); the panel kernel packs each
weight in 32-column panels and prefetches the next panel into L2 while the current one is multiplied
(``benchmarks/linear_gemm.py``: 0.67-0.69 of the roofline at 32 rows on the small checkpoint's
weights, where oneDNN reaches 0.51 and MKL 0.40). Wide inputs (prefill chunks) are packed in row
blocks and run at 0.82 of the roofline (MKL 0.89). One kernel for every row count keeps each row's
result independent of the batch it shares (bit for bit), as oneDNN did; MKL's gemv for single rows
would not. The panels replace oneDNN's packed copy, so memory is unchanged.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch
import torch.nn.functional as F

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from ops.cpu_kernels.mixed_gemm import mixed_gemm
from ops.quant.weights import LinearWeights

PANEL_COLUMNS = 32
logger = logging.getLogger(__name__)
_WARNED: set[str] = set()  # schemes whose fallback to the reference was logged


class PanelLinear:
    """A float32 weight packed in 32-column panels (and its bias); call it on ``x [..., in]``.

    Keeps a reference to ``weight`` itself (no copy) for inputs that are not float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().contiguous()
        panels = -(-self.out_features // PANEL_COLUMNS)
        self.packed = torch.empty(panels * self.in_features * PANEL_COLUMNS, dtype=torch.float32)
        stride_n, stride_k = self.weight.stride()
        lib.xllm_panel_pack(
            self.weight.data_ptr(), self.out_features, self.in_features, stride_n, stride_k,
            self.packed.data_ptr(),
        )  # fmt: skip
        self._gemm = lib.xllm_panel_gemm
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0 or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return self._call_panel(x)

    def _call_panel(self, x: torch.Tensor) -> torch.Tensor:
        """The panel kernel on float32 ``x``."""
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (a step's tokens are 2-D:
        if not flat.is_contiguous():  # no reshape and view around a few-microsecond GEMM)
            flat = flat.contiguous()
        rows = flat.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32, device=x.device)
        self._gemm(
            flat.data_ptr(), rows, self.in_features, self._packed_ptr, self.out_features,
            self._bias_ptr, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


class PanelLinearBF16:
    """A bfloat16 weight packed in 32-column panels of k pairs for the CPU's bf16 dot-product unit
    (``panel_gemm_bf16.c``: fp32 accumulation, bias in fp32); call it on ``x [..., in]``.

    float32 and bfloat16 inputs run the kernel (float32 ``x`` is rounded to bf16 as it is packed);
    the output has ``x``'s dtype, or float32 with ``float_output`` (logits: rounded once, from the
    accumulator, instead of through bf16). Other inputs fall back to ``F.linear``."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL, float_output: bool
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.float_output = float_output
        panels = -(-self.out_features // PANEL_COLUMNS)
        pairs = -(-self.in_features // 2)
        self.packed = torch.empty(panels * pairs * PANEL_COLUMNS * 2, dtype=torch.bfloat16)
        stride_n, stride_k = self.weight.stride()
        lib.xllm_panel_pack_bf16(
            self.weight.data_ptr(), 1, self.out_features, self.in_features, stride_n, stride_k,
            self.packed.data_ptr(),
        )  # fmt: skip
        self._gemm = lib.xllm_panel_gemm_bf16
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0 or x.dtype not in (torch.float32, torch.bfloat16):
            out = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
            return out.float() if self.float_output else out
        return mixed_gemm(
            x, self.out_features, self.float_output,
            lambda flat, rows, x16, out, o16: self._gemm(
                flat, x16, rows, self.in_features, self._packed_ptr, self.out_features, self._bias_ptr, out,
                o16, torch.get_num_threads(),
            ),
        )  # fmt: skip


def pack_linear(weights: LinearWeights) -> Any:
    """The CPU packed form of a linear layer: ``PanelLinear`` (float32) or ``PanelLinearBF16``
    (bfloat16, where the CPU has bf16 units) where the kernel runs, else oneDNN's. Quantized
    (``ops/linear.py`` has the schemes and layouts): "w8a8" ``PanelLinearInt8`` (``ValueError`` where
    its kernel cannot run), "int8" / "int4" ``PanelLinearWeightOnly`` (the torch reference where the CPU
    lacks AVX-512), "fp8" the torch reference."""
    from ops.onednn import pack_linear as onednn_pack

    if weights.quantization != "none":
        return _quantized(weights)
    weight, bias = weights.weight, weights.bias
    if weight.device.type != "cpu" or weight.dim() != 2:
        return onednn_pack(weight, bias)
    if weight.dtype == torch.bfloat16:
        lib = kernel_library("panel_gemm_bf16")
        return None if lib is None else PanelLinearBF16(weight, bias, lib, weights.float_output)
    if weight.dtype != torch.float32:
        return onednn_pack(weight, bias)
    lib = kernel_library("panel_gemm")
    if lib is None:
        return onednn_pack(weight, bias)
    return PanelLinear(weight, bias, lib)


def _quantized(w: LinearWeights) -> Any:
    from ops.quant import SCHEMES, reference_linear

    if w.quantization not in SCHEMES:
        raise ValueError(
            f"unknown quantization {w.quantization!r} (the CPU backend has: {', '.join(SCHEMES)})"
        )
    if w.quantization in ("int8", "int4"):
        return _weight_only(w)
    if w.quantization == "fp8" or w.zero is not None:  # (a zero point: the reference refuses it)
        return reference_linear(w)
    from ops.cpu_kernels.linear_int8 import PanelLinearInt8

    lib = kernel_library("panel_gemm_int8")
    if lib is None or w.weight.dim() != 2:
        raise ValueError(
            f"quantization w8a8 needs the int8 panel kernel, unavailable here: "
            f"{unavailable_reason('panel_gemm_int8')}; run without --quantization"
        )
    return PanelLinearInt8(w, lib)


def _weight_only(w: LinearWeights) -> Any:
    """int8 / int4 weight-only: the panel kernel (float32 FMAs; bf16 inputs on the bf16 unit where the
    CPU has one), else the torch reference, with a warning."""
    from ops.cpu_kernels.linear_wonly import PanelLinearWeightOnly
    from ops.quant import reference_linear

    w.check_symmetric()
    lib = kernel_library("panel_gemm_wonly")
    if lib is None or w.weight.dim() != 2 or w.weight.device.type != "cpu":
        if w.quantization not in _WARNED:
            _WARNED.add(w.quantization)
            logger.warning(
                "--quantization %s runs the torch reference (slow): the weight-only kernel is unavailable "
                "here: %s", w.quantization, unavailable_reason("panel_gemm_wonly"),
            )  # fmt: skip
        return reference_linear(w)
    return PanelLinearWeightOnly(w, (lib, kernel_library("panel_gemm_wonly_bf16")))
