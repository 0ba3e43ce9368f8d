"""A draft head over the target's hidden states (MTP layers, EAGLE heads), as the runner sees a model.

A head reads pairs: a hidden state of the target's at position ``t`` and the embedding of the token at
``t + 1`` (the target's embedding table), and returns two things per token: the hidden state its logits
come from and the hidden state a further draft step reads in place of the target's (``chain``). The
runner calls ``forward_tokens(input_ids, positions)`` like any model's; the hidden state of every token
rides beside them: ``prev_hidden`` ([T, width], the tokens' order) is set before the forward,
``out_hidden`` holds the chain after it, ``depth`` says which draft step it is (0: the pairs with the
target's hidden states). ``xengine/spec/head_proposer.py`` drives it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from xengine.layers.rotary import RotaryEmbedding
from xengine.models.base import BaseCausalLM


class DraftHead(Protocol):
    def __call__(
        self, positions: torch.Tensor, embeds: torch.Tensor, prev_hidden: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden for the logits, hidden for the next draft step)`` of each token."""
        ...


class DraftHeadModel(nn.Module):
    def __init__(
        self,
        target: BaseCausalLM,
        head: nn.Module,
        lm_head: nn.Module | None = None,
        draft_to_target: torch.Tensor | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        """``lm_head``: the head's own (None: the target's ``compute_logits``); ``draft_to_target``: the
        target id of each of its ids when its vocabulary is a subset (EAGLE-3); ``rotary``: its own
        position tables (None: it shares the target's)."""
        super().__init__()
        self._target = (target,)  # a tuple: not a submodule (its weights are the target's)
        self.head = head
        self.lm_head = lm_head
        self.draft_to_target = draft_to_target
        self.rotary = rotary
        self.depth = 0
        self.prev_hidden: torch.Tensor | None = None
        self.out_hidden: torch.Tensor | None = None

    @property
    def target(self) -> BaseCausalLM:
        return self._target[0]

    @property
    def num_depths(self) -> int:
        """Layers chained at one position (an MTP checkpoint's depths: ``mtp.py``); 1 for EAGLE heads."""
        return getattr(self.head, "num_depths", 1)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.prev_hidden is not None and self.prev_hidden.shape[0] == input_ids.shape[0]
        embeds = self.target.model.embed_tokens(input_ids)
        hidden, self.out_hidden = self.head(positions, embeds, self.prev_hidden.to(embeds.dtype), self.depth)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.target.compute_logits(hidden)
        logits = self.lm_head(hidden).float()
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

    def set_max_model_len(self, max_model_len: int) -> None:
        if self.rotary is not None:
            self.rotary.set_max_len(max_model_len)
