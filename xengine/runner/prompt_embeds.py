"""Prompt embeddings (vLLM's ``prompt_embeds``) in a step: which rows take given embeddings instead of
their token's, gathered per step from the requests' tensors (``Request.prompt_embeds``)."""

from __future__ import annotations

import numpy as np
import torch

from xengine.api.prompt_embeds import PromptEmbeds
from xengine.request import Request
from xengine.scheduler.plan import SchedulePlan


def embeds_tensor(embeds: PromptEmbeds, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[tokens, hidden]`` in the model's dtype on its device."""
    array = np.frombuffer(embeds.data, dtype="<f4").reshape(embeds.num_tokens, embeds.hidden_size)
    return torch.from_numpy(array.copy()).to(device=device, dtype=dtype)


def attach_embeds(
    req: Request, embeds: PromptEmbeds | None, dtype: torch.dtype, device: torch.device
) -> None:
    """Give ``req`` its prompt embeddings (None: a prompt of tokens) and their prefix-cache key."""
    if embeds is not None:
        req.prompt_embeds, req.embeds_key = embeds_tensor(embeds, dtype, device), embeds.key()


def embed_rows(plan: SchedulePlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(embeds [N, hidden], rows [N])``: the step's rows that are prompt positions of requests given
    as embeddings, and what they take; None when the step has none."""
    pieces, rows, row = [], [], 0
    for s in plan.seqs:
        given = s.req.prompt_embeds
        if given is not None and s.start < given.shape[0]:
            end = min(s.end, given.shape[0])
            pieces.append(given[s.start : end])
            rows.append(torch.arange(row, row + end - s.start))
        row += s.num_new_tokens
    if not pieces:
        return None
    return torch.cat(pieces), torch.cat(rows).to(device)
