"""``cluster.epd.workload``: the workload ``epd.strategy: auto`` profiles for (torch-free).

A named workload of ``xllm profile epd`` (``image-heavy``, ``text-heavy``), or a description: a YAML
mapping, kept on the config as its one-line flag form
``images_per_request=2,image_size=448x448,prompt_tokens=128,output_tokens=64[,request_rate=5]``.
"""

from __future__ import annotations

from typing import Any

WORKLOAD_KEYS = ("images_per_request", "image_size", "prompt_tokens", "output_tokens", "request_rate")


def workload_text(spec: dict[str, Any]) -> str:
    """A workload mapping as ``cluster.epd.workload``'s one-line form (``image_size`` as WxH)."""
    parts = []
    for key, value in spec.items():
        if key == "image_size" and isinstance(value, (list, tuple)):
            value = "x".join(str(v) for v in value)
        parts.append(f"{key}={value}")
    return ",".join(parts)


def parse_workload(text: str) -> dict[str, Any]:
    """``cluster.epd.workload`` as the profiler's workload fields (``image_size`` a (w, h) tuple,
    ``request_rate`` None for 'max'); ``ValueError`` naming what is wrong."""
    from xservice.cluster.epd.profiler import WORKLOADS

    if text in WORKLOADS:
        return {**WORKLOADS[text], "request_rate": None}
    where = f"cluster.epd.workload {text!r}"
    spec: dict[str, Any] = {"request_rate": None}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in WORKLOAD_KEYS:
            raise ValueError(
                f"{where}: expected one of {', '.join(WORKLOADS)}, or key=value items with keys "
                f"{', '.join(WORKLOAD_KEYS)}; got {item!r}"
            )
        spec[key] = _workload_value(where, key, value)
    missing = [k for k in WORKLOAD_KEYS[:4] if k not in spec]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    return spec


def parse_image_size(value: str, name: str = "image_size") -> tuple[int, int]:
    """``WxH`` in pixels as (w, h); ``ValueError`` naming ``name``."""
    w, sep, h = value.lower().partition("x")
    if not (sep and w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
        raise ValueError(f"{name} must be WxH in pixels, e.g. 448x448; got {value!r}")
    return int(w), int(h)


def parse_rate(value: str, name: str = "request_rate") -> float | None:
    """A request rate > 0, or 'max' (None: as fast as served); ``ValueError`` naming ``name``."""
    if value == "max":
        return None
    try:
        rate = float(value)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise ValueError(f"{name} must be a number > 0 or 'max'; got {value!r}")
    return rate


def _workload_value(where: str, key: str, value: str) -> Any:
    try:
        if key == "image_size":
            return parse_image_size(value)
        if key == "request_rate":
            return parse_rate(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    least = 1 if key == "output_tokens" else 0
    if not value.isdigit() or int(value) < least:
        raise ValueError(f"{where}: {key} must be an integer >= {least}; got {value!r}")
    return int(value)
