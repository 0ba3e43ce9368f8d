"""The stand-in model of an emulated accelerator (``ops/platforms/emulated.py``), math only.

It keeps the served model's vocabulary (its tokenizer, EOS ids, sampling all behave as the real one's)
and one KV layer of one head, ``WIDTH`` wide. Each new token's embedding is written to its KV slot, and
its hidden state is that embedding plus the rows the positions 1 and 16 before it left in the KV
cache -- read back through the block table, so a prefix-cache hit or a PD import of the wrong blocks
changes the tokens. The logits are a fixed random projection of it: a deterministic "bigram language" of pseudo
tokens, the same on every instance with the same seed, costing microseconds per step while the
emulated platform sleeps the step's predicted time.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from graph.forward_context import get_forward_context
from xengine.models.info import ModelInfo

WIDTH = 16
LAGS = (1, 16)  # the KV rows each token reads back: the previous position's, and one a block or so back
_SEED_SALT = 9176


def emulated_info(info: ModelInfo) -> ModelInfo:
    """``info`` with the stand-in's geometry: one KV layer of one head, ``WIDTH`` wide."""
    return dataclasses.replace(
        info, hidden_size=WIDTH, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=WIDTH
    )


class EmulatedLM(nn.Module):
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed + _SEED_SALT)
        self.embed = nn.Parameter(torch.randn(vocab_size, WIDTH, generator=gen), requires_grad=False)
        scale = 3.0 / WIDTH**0.5  # peaked enough that greedy and sampled outputs differ, not degenerate
        self.out = nn.Parameter(scale * torch.randn(WIDTH, vocab_size, generator=gen), requires_grad=False)

    def set_max_model_len(self, max_model_len: int) -> None:
        """No position tables."""

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids]
        ctx = get_forward_context()
        if ctx is None or ctx.meta is None:  # a warm-up run: no KV
            return x
        meta, cache = ctx.meta, ctx.caches[0]  # paged: [2, num_blocks, block_size, 1, WIDTH]
        n = ctx.num_tokens
        keys = cache[0].view(-1, WIDTH)
        keys.index_copy_(0, meta.slot_mapping[:n], x[:n].to(keys.dtype))
        lens = torch.tensor(meta.query_lens_cpu, device=x.device)
        seq = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
        hidden = x[:n] + sum(self._read(keys, meta, seq, positions[:n].long() - lag) for lag in LAGS)
        return torch.cat([hidden, x[n:]])

    @staticmethod
    def _read(keys: torch.Tensor, meta, seq: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Each token's sequence's KV row at position ``at`` (zeros where ``at < 0``)."""
        valid = at >= 0
        at = at.clamp(min=0)
        block = meta.block_tables[seq, at // meta.block_size].long()
        return keys[block * meta.block_size + at % meta.block_size] * valid[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.float() @ self.out).float()
