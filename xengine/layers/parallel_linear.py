"""Tensor-parallel layers (Megatron's split): column-parallel projections, row-parallel ones ending in
one all-reduce, a vocab-parallel embedding and LM head.

Each factory returns the plain layer when this process has no tensor-parallel group, so a
single-process model is built exactly as before. Under a group of N ranks:
- column-parallel (``MergedLinear`` with ``source_starts``, ``ColumnParallelLinear``): this rank's
  output rows of each (stacked) projection (q / k / v heads, gate / up columns); no communication;
- ``RowParallelLinear``: this rank's input columns; the partial products are summed by one
  all-reduce and the bias is added once, after it;
- ``VocabParallelEmbedding``: rows ``[r * V/N, (r + 1) * V/N)`` of the vocabulary (padded to a multiple
  of N); a token outside the rank's rows embeds to zero and the all-reduce puts the rows together;
- ``ParallelLMHead``: the same rows of the head; each rank computes its logits columns and one
  all-gather returns the whole vocabulary's logits (padding columns dropped).
Each layer's ``load_param`` reads only its slice of the checkpoint tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xengine.layers.checkpoint_tensor import LazyTensor, materialize, narrow
from xengine.layers.linear import Linear, MergedLinear
from xengine.parallel.tensor import all_gather_last, all_reduce, split_evenly, tp_rank_size

Checkpoint = torch.Tensor | LazyTensor


def column_linear(in_features: int, output_sizes: list[int], bias: bool, starts: list[int]) -> MergedLinear:
    """Stacked projections, split by output rows: ``output_sizes`` this rank's rows of each, beginning
    at ``starts`` in the checkpoint's tensors (ignored without a group)."""
    _, size = tp_rank_size()
    return MergedLinear(in_features, output_sizes, bias, starts if size > 1 else None)


def column_single(in_features: int, out_features: int, bias: bool, cls: type | None = None) -> nn.Linear:
    """One projection split by output rows (``out_features``: the whole model's): ``Linear``, or
    ``nn.Linear`` with ``cls=nn.Linear`` for a weight that is read, never run as a layer."""
    rank, size = tp_rank_size()
    plain = Linear if cls is None else cls
    if size == 1:
        return plain(in_features, out_features, bias=bias)
    local = split_evenly(out_features, size, f"output size of a {in_features}->{out_features} projection")
    shard = (ColumnParallelLinear if plain is Linear else ColumnParallelWeight)(in_features, local, bias=bias)
    shard.source_start = rank * local
    return shard


def row_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    """A projection split by input columns (``in_features``: the whole model's), or the plain one."""
    _, size = tp_rank_size()
    return (
        RowParallelLinear(in_features, out_features, bias)
        if size > 1
        else Linear(in_features, out_features, bias)
    )


def vocab_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    _, size = tp_rank_size()
    return (
        VocabParallelEmbedding(vocab_size, hidden_size) if size > 1 else nn.Embedding(vocab_size, hidden_size)
    )


def lm_head(hidden_size: int, vocab_size: int) -> Linear:
    _, size = tp_rank_size()
    head = (
        ParallelLMHead(hidden_size, vocab_size) if size > 1 else Linear(hidden_size, vocab_size, bias=False)
    )
    head.float_output = True  # logits in float32 straight from the GEMM's accumulators
    return head


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        rank, size = tp_rank_size()
        local = split_evenly(in_features, size, f"input size of a {in_features}->{out_features} projection")
        super().__init__(local, out_features, bias=bias)
        self.source_start = rank * local

    def fused_bias(self) -> torch.Tensor | None:
        return None  # added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(super().forward(x))
        return out if self.bias is None else out + self.bias

    def load_param(self, param_name: str, tensor: Checkpoint) -> None:
        if param_name == "weight":
            _copy(self.weight, narrow(tensor, 1, self.source_start, self.in_features), "weight")
        else:
            _copy(getattr(self, param_name), materialize(tensor), param_name)


class _RowSlice:
    """A parameter of this rank's output rows: rows ``source_start ..`` of the checkpoint's."""

    source_start: int = 0

    def load_param(self, param_name: str, tensor: Checkpoint) -> None:
        param = getattr(self, param_name)
        _copy(param, narrow(tensor, 0, self.source_start, param.shape[0]), param_name)


class ColumnParallelLinear(_RowSlice, Linear):
    """This rank's output rows of one projection (its attention heads); no communication."""


class ColumnParallelWeight(_RowSlice, nn.Linear):
    """This rank's rows of a weight that is read per head, never run as a layer (MLA's ``kv_b_proj``)."""


class _VocabRows:
    """This rank's rows of a vocabulary-sized parameter: ``rows`` each (the last rank's tail padded)."""

    def _init_rows(self, vocab_size: int) -> int:
        rank, size = tp_rank_size()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // size)
        self.row_start = rank * self.rows
        return self.rows

    def _load_rows(self, param: torch.Tensor, tensor: Checkpoint) -> None:
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(f"vocabulary weight: expected {self.vocab_size} rows, got {tuple(tensor.shape)}")
        real = max(0, min(self.rows, self.vocab_size - self.row_start))
        with torch.no_grad():
            if real:
                _copy(param[:real], narrow(tensor, 0, self.row_start, real), "vocabulary rows")
            param[real:].zero_()


class VocabParallelEmbedding(nn.Embedding, _VocabRows):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(self._init_rows(vocab_size), hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.row_start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def load_param(self, param_name: str, tensor: Checkpoint) -> None:
        self._load_rows(self.weight, tensor)


class ParallelLMHead(Linear, _VocabRows):
    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, self._init_rows(vocab_size), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last(super().forward(x))[..., : self.vocab_size]

    def load_param(self, param_name: str, tensor: Checkpoint) -> None:
        self._load_rows(self.weight, tensor)


def _copy(param: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{what}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
