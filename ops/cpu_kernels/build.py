"""Build and load this package's C kernels (once per machine, into the cache directory).

Each kernel is one C file here, compiled with AVX-512F, FMA and OpenMP (the process's libgomp, the
one torch loaded, so kernels and torch ops share one thread pool) and loaded with ``ctypes``, whose
calls release the GIL. On CPUs with AVX2, FMA and F16C but no AVX-512 the kernels of ``AVX2_BUILDS``
compile from the same source against ``avx512_on_avx2.h`` (each 16-lane vector two 8-lane halves);
the GEMMs stay on oneDNN there. ``XLLM_CPU_KERNELS=off`` keeps every op on oneDNN and the torch
reference (also the fallback where a kernel cannot run or a build fails, with a warning).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ops.native_build import build_shared_library
from xengine.api.envs import CPU_KERNELS

logger = logging.getLogger(__name__)

# "auto" (where the CPU has AVX-512) | "off" | kernels to turn off, e.g. "-elementwise,-panel_gemm"
ENV_KERNELS = CPU_KERNELS.name
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-Wall"]
# kernels that also build for AVX2 + FMA + F16C (the GEMMs' register tiling is AVX-512's), and how
AVX2_BUILDS = ("row_argmax", "elementwise", "decode_attention", "recurrent_scan")
FLAGS_AVX2 = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-Wall"]
# kernel -> (extra compiler flags, the ``CpuFeatures`` field its instructions need)
EXTRA: dict[str, tuple[list[str], str]] = {
    "panel_gemm_bf16": (["-mavx512bf16", "-mavx512bw", "-mavx512vl"], "avx512_bf16"),
    "panel_gemm_int8": (["-mavx512vnni", "-mavx512bw", "-mavx512vl"], "avx512_vnni"),
    "panel_gemm_wonly_bf16": (["-mavx512bf16", "-mavx512bw", "-mavx512vl"], "avx512_bf16"),
}

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
# weight-only int8 / int4 GEMM (panel_gemm_wonly.h): x, x_bf16, m, k, packed, bits, scales, zeros, group,
# groups, n, bias, out, out_bf16, threads
_WONLY = [_ptr, _i32, _i64, _i64, _ptr, _i32, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i32, _i32]
# kernel -> {function: argtypes}
SIGNATURES: dict[str, dict[str, list]] = {
    "panel_gemm": {
        "xllm_panel_pack": [_ptr, _i64, _i64, _i64, _i64, _ptr],
        "xllm_panel_gemm": [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i32],
    },
    "panel_gemm_bf16": {
        "xllm_panel_pack_bf16": [_ptr, _i32, _i64, _i64, _i64, _i64, _ptr],
        "xllm_panel_gemm_bf16": [_ptr, _i32, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i32, _i32],
    },
    "panel_gemm_int8": {
        "xllm_panel_pack_int8": [_ptr, _i32, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr],
        "xllm_panel_gemm_int8": [_ptr, _i32, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i32, _i32],
    },
    "panel_gemm_wonly": {"xllm_wonly_gemm_f32": _WONLY},
    "panel_gemm_wonly_bf16": {"xllm_wonly_gemm_bf16": _WONLY},
    "row_argmax": {"xllm_row_argmax": [_ptr, _i64, _i64, _i64, _ptr, _i32]},
    "elementwise": {
        "xllm_rms_norm": [_ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _f32, _i32],
        "xllm_rms_norm_bf16": [
            _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _f32, _i32,
        ],
        "xllm_silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i32],
        "xllm_silu_and_mul_bf16": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i32],
        "xllm_rope_neox": [
            _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32,
        ],
        "xllm_rope_neox_bf16": [
            _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32,
        ],
    },
    "recurrent_scan": {
        "xllm_gated_delta_f32": [
            _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _i32,
            _i32,
        ],
        "xllm_ssd_scan_f32": [
            _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i32,
        ],
    },
    "decode_attention": {
        "xllm_decode_attention_supported": [_i64, _i64, _i64],
        "xllm_store_kv": [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64],
        "xllm_decode_attention_paged": [
            _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr,
            _i64, _f32, _i32,
        ],
        "xllm_decode_attention_paged_bf16": [
            _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr,
            _i64, _f32, _i32,
        ],
        "xllm_decode_attention_slots": [
            _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _f32, _i32,
        ],
        "xllm_decode_attention_slots_bf16": [
            _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _f32, _i32,
        ],
        "xllm_decode_attention_paged_q8": [
            _ptr, _ptr, _i32, _i32, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64,
            _ptr, _i64, _f32, _i32,
        ],
        "xllm_decode_attention_slots_q8": [
            _ptr, _ptr, _i32, _i32, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64,
            _f32, _i32,
        ],
        "xllm_store_kv_q8": [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i32, _i32, _i32],
    },
}  # fmt: skip

_libs: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}


def kernels_disabled_reason(name: str | None = None) -> str | None:
    """Why no kernel (or kernel ``name``) runs on this machine (None: it may)."""
    choice = CPU_KERNELS.get().lower().replace(" ", "")
    parts = [] if choice in ("auto", "off") else choice.split(",")
    off = {p[1:] for p in parts}  # "-elementwise,-panel_gemm"
    if any(not p.startswith("-") for p in parts) or off - set(SIGNATURES):
        raise ValueError(
            f"invalid value for {ENV_KERNELS}: {choice!r}; choose auto, off, or kernels to turn off "
            f"as -name[,-name...] ({', '.join(SIGNATURES)})"
        )
    if choice == "off":
        return f"{ENV_KERNELS}=off"
    if name in off:
        return f"{ENV_KERNELS} turns {name} off"
    from ops.platforms.cpu_features import cpu_features

    if not _avx512():
        if name in AVX2_BUILDS and cpu_features().avx2_fma_f16c:
            return None
        capability = torch.backends.cpu.get_cpu_capability()
        return f"the CPU lacks AVX-512 (torch reports {capability})"
    if name in EXTRA:
        feature = EXTRA[name][1]
        if not getattr(cpu_features(), feature):
            return f"the CPU lacks {feature}"
    return None


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")


def kernel_library(name: str) -> ctypes.CDLL | None:
    """The loaded kernel ``name`` (``<name>.c``), built on first use; None where it cannot run."""
    if name in _libs:
        return _libs[name]
    lib = None
    reason = kernels_disabled_reason(name)
    if reason is None:
        source = Path(__file__).with_name(f"{name}.c")
        try:
            headers = sorted(source.parent.glob("*.h"))  # shared includes: an edit rebuilds
            flags = (FLAGS if _avx512() else FLAGS_AVX2) + EXTRA.get(name, ([], ""))[0]
            path = build_shared_library(
                source, flags, f"the CPU kernel {source}", libs=["-lm"], depends=headers
            )
            lib = ctypes.CDLL(str(path))
            for fn, argtypes in SIGNATURES[name].items():
                getattr(lib, fn).argtypes = argtypes
                getattr(lib, fn).restype = _i32 if fn.endswith("_supported") else None
        except (OSError, RuntimeError) as e:
            reason = str(e)
            logger.warning("CPU kernel %s unavailable (the reference path runs instead): %s", name, e)
    _libs[name] = lib
    if reason is not None:
        _errors[name] = reason
    return lib


def unavailable_reason(name: str) -> str | None:
    """Why ``kernel_library(name)`` is None (None when it is loaded)."""
    kernel_library(name)
    return _errors.get(name)


def build_all() -> dict[str, str]:
    """Build (or find built) every kernel; ``{name: "ok" | why not}`` (``ci/setup.sh`` runs this)."""
    return {name: unavailable_reason(name) or "ok" for name in SIGNATURES}
