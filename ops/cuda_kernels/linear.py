"""``pack_linear`` for CUDA: the quantized linear layers of ``--quantization``, by scheme.

- "none": None — the layer keeps ``F.linear`` (cuBLAS is already the right GEMM);
- "w8a8": ``W8A8Linear`` (int8 tensor cores, ``torch._int_mm``);
- "fp8": ``FP8Linear`` (``torch._scaled_mm``), on compute capability 8.9 and newer; an older device
  is refused with a ``ValueError`` that names the flag and the device, never run as something else;
- any other scheme (weight-only "int8", "int4"): the reference backend's ``pack_linear``.
"""

from __future__ import annotations

from typing import Any

from ops.platforms.cuda import device_capability
from ops.quant.weights import LinearWeights

FP8_MIN_CAPABILITY = (8, 9)  # Ada: the first fp8 tensor cores
ROWWISE_MIN_CAPABILITY = (9, 0)  # _scaled_mm's row-wise scaling (scales and bias in the epilogue)
INT8_MIN_CAPABILITY = (7, 5)  # Turing: int8 tensor cores


def pack_linear(weights: LinearWeights) -> Any:
    """The CUDA packed form of a linear layer for its ``quantization`` (see the module docstring), or
    None (plain ``F.linear``)."""
    w = weights
    if w.quantization not in ("w8a8", "fp8"):  # none and weight-only: the reference backend's
        from ops.torch_ref import pack_linear as reference_pack

        return reference_pack(w)
    w.check_symmetric()
    capability, name = device_capability(w.weight.device)
    if w.quantization == "w8a8":
        from ops.cuda_kernels.linear_w8a8 import W8A8Linear

        check_capability("w8a8", capability, name, INT8_MIN_CAPABILITY, "int8 tensor cores")
        return W8A8Linear(w)
    from ops.cuda_kernels.linear_fp8 import FP8Linear

    check_capability("fp8", capability, name, FP8_MIN_CAPABILITY, "fp8 tensor cores")
    rowwise = capability is None or capability >= ROWWISE_MIN_CAPABILITY
    return FP8Linear(w, rowwise=rowwise)


def check_capability(
    scheme: str, capability: tuple[int, int] | None, name: str, minimum: tuple[int, int], units: str
) -> None:
    """``ValueError`` naming ``--quantization scheme`` and the device where ``capability`` is below
    ``minimum`` (None: not a CUDA device, nothing to check)."""
    if capability is None or tuple(capability) >= minimum:
        return
    have, need = "sm{}{}".format(*capability), "sm{}{}".format(*minimum)
    other = "none or w8a8" if scheme == "fp8" else "none"
    raise ValueError(
        f"--quantization {scheme} needs {units} (CUDA compute capability {need} or newer); this device, "
        f"{name}, is {have}: run with --quantization {other}"
    )
