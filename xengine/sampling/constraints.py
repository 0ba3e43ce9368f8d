"""Token-level constraints of the sampler: bad words, allow-lists, logit biases and grammar bitmasks.

Each takes per-row inputs (None / empty = the row is unconstrained) and returns new logits; the
order they run in is ``process_logits``' (``sampler.py``). The grammar mask runs last and wins: if
the bans, allow-list and biases before it leave a constrained row no allowed id at all (say
``min_tokens`` banning eos where the grammar allows only eos), that row is masked by the grammar
alone, so the output still parses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xengine.api.messages import SamplingParams
from xengine.sampling.penalties import token_mask
from xengine.structured.bitmask import apply_bitmask, bitmask_bias

_NEG_INF = float("-inf")


@dataclass
class LogitBias:
    """Sparse biases of one step: ``logits[rows[i], ids[i]] += values[i]``."""

    rows: torch.Tensor  # int64 [N]
    ids: torch.Tensor  # int64 [N]
    values: torch.Tensor  # float32 [N]

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device) -> LogitBias | None:
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for row, p in enumerate(params):
            for token, value in (p.logit_bias or {}).items():
                rows.append(row)
                ids.append(int(token))
                values.append(float(value))
        if not rows:
            return None
        return cls(
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device),
        )


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    return logits.index_put((bias.rows, bias.ids), bias.values.to(logits.dtype), accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, allowed: list[list[int] | None]) -> torch.Tensor:
    """Rows with an allow-list keep only those ids (the others become -inf)."""
    rows = [r for r, ids in enumerate(allowed) if ids is not None]
    if not rows:
        return logits
    keep = token_mask([allowed[r] for r in rows], logits.shape[1], logits.device)
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~keep, _NEG_INF)
    return out


def bad_words_bans(bad_words: list[list[list[int]]], histories: list[list[int]]) -> list[list[int]]:
    """Per row, the ids banned now: each bad sequence's last id, when the row's output ends with the
    rest of it (a one-token sequence: always)."""
    bans: list[list[int]] = []
    for words, history in zip(bad_words, histories):
        banned = []
        for word in words:
            prefix = word[:-1]
            if not prefix or (
                len(history) >= len(prefix) and history[len(history) - len(prefix) :] == prefix
            ):
                banned.append(word[-1])
        bans.append(banned)
    return bans


def apply_grammar(
    logits: torch.Tensor, unconstrained: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
) -> torch.Tensor:
    """Mask ``rows`` by their bitmask rows; a row left with no finite logit falls back to
    ``unconstrained`` (the logits before bans and biases) masked by its grammar alone.

    ``unconstrained`` is never written. When every row is constrained (the common case) this is one
    out-of-place add and one max over the logits: no copy, no gather."""
    bias = bitmask_bias(bitmask[: len(rows)], logits.shape[1]).to(logits.device, logits.dtype)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits = logits + bias if logits is unconstrained else logits.add_(bias)
        best = logits.amax(dim=1)
    else:
        if logits is unconstrained:
            logits = logits.clone()
        index = torch.tensor(rows, device=logits.device)
        logits.index_add_(0, index, bias)
        best = logits[index].amax(dim=1)
    dead = best == _NEG_INF
    if bool(dead.any()):
        dead_rows = [r for r, d in zip(rows, dead.tolist()) if d]
        dead_masks = bitmask[: len(rows)][dead.cpu()]
        fixed = apply_bitmask(unconstrained[dead_rows].clone(), dead_masks, list(range(len(dead_rows))))
        fixed_dead = fixed.amax(dim=1) == _NEG_INF  # the grammar allows nothing: leave the row free
        fixed[fixed_dead] = unconstrained[dead_rows][fixed_dead]
        logits[torch.tensor(dead_rows, device=logits.device)] = fixed
    return logits
