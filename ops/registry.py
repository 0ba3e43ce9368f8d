"""Op registry: ``(op name, platform name) -> implementation``, with the pure-torch reference
backend (``torch_ref``) as the fallback for every platform.

Backends register lazily: a factory per platform (``register_backend``) is called the first time an
op is looked up on that platform, so a backend's kernel libraries are only imported where they exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ops.platforms import current_platform

REFERENCE = "torch_ref"

_ops: dict[tuple[str, str], Callable[..., Any]] = {}
_resolved: dict[tuple[str, str], Callable[..., Any]] = {}
_factories: dict[str, list[Callable[[], None]]] = {}
_loaded: set[str] = set()


def _load_torch_ref() -> None:
    from ops.torch_ref import reference_ops

    for name, fn in reference_ops().items():  # CPU and every platform fall back to these
        register_op(name, REFERENCE, fn)


def register_backend(platform_name: str, factory: Callable[[], None]) -> None:
    """Add a lazy factory that registers ops for ``platform_name`` on first lookup there.

    Backends add themselves here: the C kernels for "cpu"; for "cuda" the quantized linear layers
    (``ops/cuda_kernels``) and the Triton kernels (only the ops full device graphs need; the rest of
    CUDA runs the reference ops); for "npu" the W8A8 linear layers (``ops/npu_kernels``).
    """
    _factories.setdefault(platform_name, []).append(factory)
    _loaded.discard(platform_name)


def register_op(name: str, platform_name: str, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as op ``name`` for ``platform_name`` (``REFERENCE`` for the fallback)."""
    _ops[(name, platform_name)] = fn
    _resolved.clear()


def _ensure_loaded(platform_name: str) -> None:
    if platform_name in _loaded:
        return
    _loaded.add(platform_name)
    for factory in _factories.get(platform_name, []):
        factory()


def get_op(name: str, platform_name: str | None = None) -> Callable[..., Any]:
    """Implementation of op ``name`` for ``platform_name`` (default: the current platform),
    falling back to the reference implementation."""
    if platform_name is None:
        platform_name = current_platform().name
    key = (name, platform_name)
    fn = _resolved.get(key)
    if fn is not None:
        return fn
    _ensure_loaded(platform_name)
    _ensure_loaded(REFERENCE)
    fn = _ops.get(key) or _ops.get((name, REFERENCE))
    if fn is None:
        raise KeyError(f"no implementation of op {name!r} for platform {platform_name!r} nor {REFERENCE!r}")
    _resolved[key] = fn
    return fn


def _load_cuda() -> None:
    from ops.cuda_kernels import cuda_kernel_ops  # torch's own GEMMs: quantized linear layers

    for name, fn in cuda_kernel_ops().items():
        register_op(name, "cuda", fn)
    try:  # Triton ships with torch's CUDA builds; without it CUDA runs the reference ops
        from ops.triton_kernels import triton_ops
    except ImportError:
        return
    for name, fn in triton_ops().items():
        register_op(name, "cuda", fn)


def _load_npu() -> None:
    from ops.npu_kernels import npu_kernel_ops  # torch_npu is imported by the ops themselves, lazily

    for name, fn in npu_kernel_ops().items():
        register_op(name, "npu", fn)


def _load_cpu() -> None:
    from ops.cpu_kernels import cpu_kernel_ops  # C kernels, falling back to oneDNN and torch_ref

    for name, fn in cpu_kernel_ops().items():
        register_op(name, "cpu", fn)


register_backend(REFERENCE, _load_torch_ref)
register_backend("cpu", _load_cpu)
register_backend("cuda", _load_cuda)
register_backend("npu", _load_npu)
