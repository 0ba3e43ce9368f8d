"""Tensor-parallel state of this process and its two collectives (all-reduce, all-gather).

Set once at start-up, before the model is built, by the engine (rank 0) or a worker (ranks 1..N-1),
so the parallel layers (``xengine/layers/parallel_linear.py``) know their slice; ``None`` in a
single-process engine, where every layer is the plain one. The collectives run over the group's
communicator: shared memory between ranks of one host (``shm_comm.py``), ``torch.distributed`` else.

Inside ``torch.compile`` the all-reduce is one opaque custom op (``xllm::tp_all_reduce``). During
graph capture and warm-up (no attention metadata in the forward context) layers skip their
collectives: ranks capture independently, and those forwards compute nothing real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graph.forward_context import get_forward_context


@dataclass
class TensorParallel:
    rank: int
    size: int
    comm: Any  # ``ShmCommunicator`` (one host) or ``DistCommunicator``: ``all_reduce``, ``all_gather``
    num_all_reduces: int = 0
    channel: Any = None  # ``StepChannel``: rank 0's step messages through shared memory (one host)


_current: TensorParallel | None = None


def set_tensor_parallel(tp: TensorParallel | None) -> None:
    global _current
    _current = tp


def get_tensor_parallel() -> TensorParallel | None:
    return _current


def tp_rank_size() -> tuple[int, int]:
    """``(rank, size)`` of this process in its tensor-parallel group; ``(0, 1)`` without one."""
    tp = _current
    return (0, 1) if tp is None else (tp.rank, tp.size)


def split_evenly(total: int, size: int, what: str) -> int:
    """``total / size``, or a ``ValueError`` saying what does not divide."""
    if total % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {what} ({total})")
    return total // size


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads rank ``rank`` holds: an even split, or one head replicated
    on ``size / num_kv_heads`` consecutive ranks when the group is larger than the head count."""
    if size <= num_kv_heads:
        count = split_evenly(num_kv_heads, size, "number of KV heads")
        return rank * count, count
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} must be a multiple of the number of KV heads ({num_kv_heads}) "
            "when it exceeds it (each KV head is replicated on size / heads ranks)"
        )
    return rank * num_kv_heads // size, 1


def _in_real_forward() -> bool:
    ctx = get_forward_context()
    return ctx is None or ctx.meta is not None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the group; ``x`` is a temporary of the caller (a layer's output), which
    the eager path overwrites with the sum. Unchanged without a group, or during capture / warm-up."""
    tp = _current
    if tp is None or tp.size == 1:
        return x
    if torch.compiler.is_compiling():
        return torch.ops.xllm.tp_all_reduce(x)
    if get_forward_context() is not None and not _in_real_forward():
        return x
    return _reduce(tp, x.contiguous())


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dim, in rank order (outside compiled graphs)."""
    tp = _current
    if tp is None or tp.size == 1:
        return x
    return tp.comm.all_gather(x.contiguous(), dim=-1)


def _reduce(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    tp.num_all_reduces += 1
    return tp.comm.all_reduce(x)


@torch.library.custom_op("xllm::tp_all_reduce", mutates_args=())
def _tp_all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    tp = _current
    if tp is None or not _in_real_forward():
        return x.clone()
    return _reduce(tp, x.clone(memory_format=torch.contiguous_format))


@_tp_all_reduce_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
