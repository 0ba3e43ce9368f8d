"""Platform resolution: explicit ``device`` > env ``XLLM_DEVICE`` > detection (npu, cuda, cpu).

This package is the only place in the codebase that names devices.
"""

from __future__ import annotations

from ops.platforms.base import Capabilities, Platform
from ops.platforms.cpu import CpuPlatform
from ops.platforms.cuda import CudaPlatform
from ops.platforms.emulated import EmulatedPlatform
from ops.platforms.npu import NpuPlatform
from xengine.api.envs import DEVICE

__all__ = [
    "Capabilities",
    "Platform",
    "current_platform",
    "platform_names",
    "resolve_platform",
    "set_platform",
]

# Detection order: the first available wins.
_PLATFORMS: dict[str, type[Platform]] = {"npu": NpuPlatform, "cuda": CudaPlatform, "cpu": CpuPlatform}
# Never detected, only asked for: an accelerator emulated from a device profile (``emulated.py``).
_EXPLICIT: dict[str, type[Platform]] = {"emulated": EmulatedPlatform}
ENV_DEVICE = DEVICE.name

_current: Platform | None = None


def platform_names() -> list[str]:
    """Names accepted by ``resolve_platform``."""
    return [*_PLATFORMS, *_EXPLICIT]


def resolve_platform(device: str | None = None) -> Platform:
    """Return the platform for ``device`` ("cpu" | "cuda" | "npu", an index suffix like "cuda:1" is
    ignored), else ``$XLLM_DEVICE``, else the first available one. Raises ``ValueError`` for an unknown
    or unavailable device."""
    requested = device or DEVICE.get() or None
    if requested is None:
        for cls in _PLATFORMS.values():
            if cls.is_available():
                return cls()
        return CpuPlatform()
    name = requested.strip().lower().split(":", 1)[0]
    cls = _PLATFORMS.get(name) or _EXPLICIT.get(name)
    source = "device argument" if device else f"${ENV_DEVICE}"
    if cls is None:
        raise ValueError(
            f"unknown device {requested!r} (from {source}); choose one of: {', '.join(platform_names())}"
        )
    if not cls.is_available():
        raise ValueError(
            f"device {name!r} (from {source}) is not available in this process; "
            f"check the driver/toolkit install or pick another device ({', '.join(_PLATFORMS)})"
        )
    return cls()


def current_platform() -> Platform:
    """The process-wide platform: the one given to ``set_platform``, else resolved once and cached."""
    global _current
    if _current is None:
        _current = resolve_platform()
    return _current


def set_platform(platform: Platform | None) -> None:
    """Set the process-wide platform (at engine start); ``None`` clears it so it is resolved again."""
    global _current
    _current = platform
