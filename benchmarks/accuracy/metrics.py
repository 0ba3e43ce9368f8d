"""Scores of one mode's logits against the reference's over the same positions.

- ``agreement``: fraction of positions whose argmax equals the reference's (teacher-forced next token);
- ``confident_agreement``: the same over the positions where the reference's top-1 logit leads its
  top-2 by more than ``margin`` (random checkpoints have near-flat logits, where an argmax flips on any
  rounding: those positions say nothing about a mode's accuracy);
- ``mean_kl`` / ``max_kl``: KL(reference || mode) of the next-token distributions, in nats, computed
  in float64 so that identical logits give exactly 0;
- ``max_abs_logit_diff``: the largest difference of one logit (0 where a mode is bitwise the reference).
"""

from __future__ import annotations

import dataclasses

import torch

_KL_ROWS = 128  # rows per float64 softmax (a [rows, vocab] float64 pair stays tens of MB)


@dataclasses.dataclass
class ModeScore:
    """Running totals of one mode over the positions seen so far."""

    num_positions: int = 0
    num_agree: int = 0
    num_confident: int = 0
    num_confident_agree: int = 0
    kl_sum: float = 0.0
    max_kl: float = 0.0
    max_abs_logit_diff: float = 0.0

    def add(self, reference: torch.Tensor, logits: torch.Tensor, margin: float) -> None:
        """Score ``logits`` against ``reference`` (both ``[positions, vocab]`` float32)."""
        if reference.shape != logits.shape:
            raise ValueError(f"logits of shape {tuple(logits.shape)} vs reference {tuple(reference.shape)}")
        if reference.shape[0] == 0:
            return
        top = reference.topk(2, dim=-1)
        agree = logits.argmax(dim=-1) == top.indices[:, 0]
        confident = (top.values[:, 0] - top.values[:, 1]) > margin
        kl = kl_divergence(reference, logits)
        self.num_positions += reference.shape[0]
        self.num_agree += int(agree.sum())
        self.num_confident += int(confident.sum())
        self.num_confident_agree += int((agree & confident).sum())
        self.kl_sum += float(kl.sum())
        self.max_kl = max(self.max_kl, float(kl.max()))
        self.max_abs_logit_diff = max(self.max_abs_logit_diff, float((logits - reference).abs().max()))

    def summary(self) -> dict[str, float | int | None]:
        """The JSON of this mode: agreements, KL and the counts behind them."""
        n, c = self.num_positions, self.num_confident
        return {
            "agreement": self.num_agree / n if n else None,
            "confident_agreement": self.num_confident_agree / c if c else None,
            "mean_kl": self.kl_sum / n if n else None,
            "max_kl": self.max_kl,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "num_positions": n,
            "num_confident_positions": c,
        }


def kl_divergence(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) per row, float64 ``[rows]``."""
    out = []
    for start in range(0, reference.shape[0], _KL_ROWS):
        p = reference[start : start + _KL_ROWS].double().log_softmax(dim=-1)
        q = logits[start : start + _KL_ROWS].double().log_softmax(dim=-1)
        out.append((p.exp() * (p - q)).sum(dim=-1).clamp_(min=0.0))
    return torch.cat(out)
