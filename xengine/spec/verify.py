"""Verification of draft tokens against the target's distributions, in the target's own step.

A sequence that drafted ``d`` tokens has ``d + 1`` consecutive sampling rows: row ``j`` is the target's
distribution of the token after the sequence's tokens and the first ``j`` drafts, processed exactly as
without speculation (penalties and ``min_tokens`` see those drafts as outputs; temperature, top-k/p,
min-p). Walking the rows in order:

- a greedy row accepts the draft when it is the row's argmax, else emits the argmax and stops;
- a random row accepts draft ``x`` with probability ``p(x)`` (Leviathan et al. with a point-mass
  draft, ``min(1, p(x) / q(x))`` with ``q(x) = 1``), else emits a draw from the residual ``p`` with
  ``x`` removed, renormalised, and stops;
- after ``d`` acceptances the last row's token (argmax or a draw) is emitted as well (the bonus).

Each emitted token is therefore distributed exactly as the target's own next token: speculation changes
the speed, never the distribution (``tests/xengine/spec/test_verify.py`` checks it with chi-square).
Random draws use the sequence's seeded generator when it has one, one uniform per decision, so a seeded
request is reproducible (though its tokens differ from a run without speculation, which draws once per
token). A sequence without drafts (``d = 0``) draws exactly as the plain sampler does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xengine.sampling.metadata import GREEDY_TEMPERATURE, SamplingMetadata
from xengine.sampling.sampler import inverse_cdf_sample, row_argmax, sampling_probs


@dataclass
class DraftGroup:
    """One sampling sequence's rows: ``first_row`` .. ``first_row + len(drafts)``."""

    first_row: int
    drafts: list[int]


def verify(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    groups: list[DraftGroup],
    accept_rule: object = None,
) -> list[list[tuple[int, int]]]:
    """Per group, the emitted ``(row, token id)`` pairs: the accepted drafts, then one more token.

    ``logits``: the processed logits of every row (``process_logits``); ``accept_rule`` replaces the
    acceptance probability ``p(x)`` by ``accept_rule(p(x))`` (a test's deliberately wrong rule only)."""
    greedy = (meta.temperature < GREEDY_TEMPERATURE).tolist() if not meta.all_greedy else None
    argmax = row_argmax(logits).tolist()
    probs = sampling_probs(logits, meta) if not meta.all_greedy else None
    out = []
    for group in groups:
        emitted: list[tuple[int, int]] = []
        for j, draft in enumerate(group.drafts):
            row = group.first_row + j
            if greedy is None or greedy[row]:
                if argmax[row] != draft:
                    emitted.append((row, argmax[row]))
                    break
            else:
                assert probs is not None
                gen = meta.generators.get(row)
                p = probs[row]
                accept = float(p[draft] / p.sum())
                if accept_rule is not None:
                    accept = accept_rule(accept)  # type: ignore[operator]
                if float(_uniform(gen)) >= accept:
                    residual = p.clone()
                    residual[draft] = 0.0
                    if float(residual.sum()) <= 0.0:  # the draft held all the mass: nothing to reject to
                        emitted.append((row, draft))
                        break
                    emitted.append((row, int(inverse_cdf_sample(residual[None], _gens(gen))[0])))
                    break
            emitted.append((row, draft))
        else:
            row = group.first_row + len(group.drafts)
            if greedy is None or greedy[row]:
                emitted.append((row, argmax[row]))
            else:
                assert probs is not None
                gen = meta.generators.get(row)
                emitted.append((row, int(inverse_cdf_sample(probs[row : row + 1], _gens(gen))[0])))
        out.append(emitted)
    return out


def _uniform(gen: torch.Generator | None) -> torch.Tensor:
    return torch.rand(1, generator=gen, device=gen.device) if gen is not None else torch.rand(1)


def _gens(gen: torch.Generator | None) -> dict[int, torch.Generator]:
    return {0: gen} if gen is not None else {}
