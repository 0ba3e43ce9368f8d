"""``inference_mode`` entered once per step, not once per runner call.

A step calls ``execute``, which calls ``prepare`` and ``run``; the overlapped loop calls the last two
apart (the forward on a worker thread). Each needs inference mode; entering it costs about 3 µs per
call even when it is already on, so a call made inside it runs as it is. The loops that step an engine
(the engine process, ``LLM.generate``) enter it once around all their steps: with the caches cold
from the forward, entering and leaving it cost ~50 µs a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def inference(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` under ``torch.inference_mode()``, entered only when the calling thread is not in it."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper
