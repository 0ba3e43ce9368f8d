"""Checks shared by the packed-GEMM kernel tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_rows_independent(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """``layer(x)`` row by row equals ``layer(x)`` at once, on one thread and on two (bit for bit)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, alone)
    assert torch.equal(whole, two)
