"""Opaque ops for compiled graphs: ``xllm::NAME`` registered straight with torch's dispatcher.

A graph runner compiles everything around some calls it must not trace (attention over the step's
caches, packed linear weights, fused experts); each is one op whose Python body runs at replay.
A plain ``torch.library.Library`` definition with one kernel for every backend
(``CompositeExplicitAutograd``) costs a fraction of ``torch.library.custom_op``'s wrapping, paid by
every layer of every step. The op is functional to the compiler (no aliasing, no mutation it can see)
and has a fake kernel for tracing. See ``docs/engine_performance.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIBRARY = torch.library.Library("xllm", "FRAGMENT")  # kept alive: the registrations live with it


def opaque_op(schema: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: define ``xllm::`` + ``schema`` (e.g. ``"attention(Tensor q, int layer) -> Tensor"``)
    with the decorated function as its kernel on every backend and ``fake`` for tracing; returns the
    op (``torch.ops.xllm.NAME.default``), called like the function."""
    name = schema.split("(", 1)[0]

    def register(fn: Callable[..., Any]) -> Any:
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"xllm::{name}", fake, lib=_LIBRARY)
        return getattr(torch.ops.xllm, name).default

    return register
