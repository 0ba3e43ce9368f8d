"""Beam search building blocks: per-beam candidates on the device, top-k selection on the host,
finished hypotheses.

Host-side selection follows the xLLM report (§4.5.1): every beam's candidates arrive sorted by
descending logprob; one min-heap of size ``num_select`` holds the best cumulative scores seen so
far, and a beam's scan stops at the first candidate that cannot beat the heap top (all later ones
are smaller). The heap and output buffers belong to the selector and are reused across steps.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

NEG_INF = float("-inf")


class BeamSelector:
    """Top ``num_select`` ``(score, beam, token)`` over ``beam_scores[b] + cand_logprobs[b][j]``.

    ``cand_logprobs[b]`` must be sorted in descending order; -inf entries (masked tokens) end a row.
    Results land in ``scores`` / ``beam_indices`` / ``token_ids`` (best first) and stay valid until
    the next ``select``. Ties keep the lower (beam, rank) first, like a stable full sort.
    """

    def __init__(self, num_select: int) -> None:
        if num_select < 1:
            raise ValueError("num_select must be >= 1")
        self.num_select = num_select
        self._heap: list[tuple[float, int, int, int]] = []  # (score, -beam, -rank, token): min first
        self.scores: list[float] = []
        self.beam_indices: list[int] = []
        self.token_ids: list[int] = []
        self.num_visited = 0  # candidates looked at by the last select (early termination measure)

    def select(
        self,
        beam_scores: list[float],
        cand_logprobs: list[list[float]],
        cand_token_ids: list[list[int]],
    ) -> int:
        """Select; returns how many were selected (< num_select only if candidates run out)."""
        heap = self._heap
        heap.clear()
        size = self.num_select
        visited = 0
        for b, base in enumerate(beam_scores):
            ids = cand_token_ids[b]
            for j, logprob in enumerate(cand_logprobs[b]):
                visited += 1
                score = base + logprob
                if score == NEG_INF:
                    break
                if len(heap) < size:
                    heapq.heappush(heap, (score, -b, -j, ids[j]))
                elif score > heap[0][0]:
                    heapq.heapreplace(heap, (score, -b, -j, ids[j]))
                else:
                    break  # sorted row: nothing after this candidate can enter the heap
        self.num_visited = visited
        heap.sort(reverse=True)
        self.scores.clear()
        self.beam_indices.clear()
        self.token_ids.clear()
        for score, neg_beam, _, token_id in heap:
            self.scores.append(score)
            self.beam_indices.append(-neg_beam)
            self.token_ids.append(token_id)
        return len(heap)


def select_brute_force(
    beam_scores: list[float], cand_logprobs: list[list[float]], cand_token_ids: list[list[int]], k: int
) -> list[tuple[float, int, int]]:
    """Reference for tests: full sort of every finite candidate, best first, ties by (beam, rank)."""
    allc = [
        (base + lp, b, j, cand_token_ids[b][j])
        for b, base in enumerate(beam_scores)
        for j, lp in enumerate(cand_logprobs[b])
        if base + lp != NEG_INF
    ]
    allc.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(s, b, t) for s, b, _, t in allc[:k]]


@dataclass
class BeamRows:
    """The beam-search rows of one step's logits batch."""

    rows: list[int] = field(default_factory=list)  # row in the logits batch
    num_candidates: list[int] = field(default_factory=list)  # top-C per row
    banned_token_ids: list[list[int]] = field(default_factory=list)  # -inf (min_tokens)
    allowed_token_ids: list[np.ndarray | None] = field(default_factory=list)  # catalog trie; None = all


def beam_candidates(logits: torch.Tensor, spec: BeamRows) -> tuple[list[list[float]], list[list[int]]]:
    """Per beam row: the top-C (logprob, token) pairs, logprob descending.

    Logprobs are ``log_softmax`` over the whole vocabulary (as HF beam search scores), then banned
    and non-catalog tokens are set to -inf, so a catalog item's score is its plain sum of logprobs.
    """
    logprobs = logits[spec.rows].float().log_softmax(dim=-1)
    num_rows, vocab = logprobs.shape
    device = logprobs.device
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    for r, banned in enumerate(spec.banned_token_ids):
        mask_rows.extend([r] * len(banned))
        mask_cols.extend(banned)
    if mask_rows:
        logprobs[torch.tensor(mask_rows, device=device), torch.tensor(mask_cols, device=device)] = NEG_INF
    constrained = [r for r, a in enumerate(spec.allowed_token_ids) if a is not None]
    if constrained:
        keep = torch.ones((num_rows, vocab), dtype=torch.bool, device=device)
        keep[torch.tensor(constrained, device=device)] = False
        allowed = [spec.allowed_token_ids[r] for r in constrained]
        idx_r = np.concatenate([np.full(len(a), r, dtype=np.int64) for r, a in zip(constrained, allowed)])
        idx_c = np.concatenate(allowed)
        keep[torch.from_numpy(idx_r).to(device), torch.from_numpy(idx_c).to(device)] = True
        logprobs.masked_fill_(~keep, NEG_INF)
    num_top = min(max(spec.num_candidates), vocab)
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    lp_rows, id_rows = top_lp.tolist(), top_ids.tolist()
    return (
        [lp[:c] for lp, c in zip(lp_rows, spec.num_candidates)],
        [ids[:c] for ids, c in zip(id_rows, spec.num_candidates)],
    )


@dataclass
class Hypothesis:
    score: float  # length-penalised
    cumulative_logprob: float
    token_ids: list[int]
    finished_by_stop: bool  # ended with an eos / stop token (else: length)


class BeamHypotheses:
    """The best ``num_beams`` finished sequences so far, best first (HF ``_update_finished_beams``)."""

    def __init__(self, num_beams: int, length_penalty: float) -> None:
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.hyps: list[Hypothesis] = []

    def penalised(self, cumulative_logprob: float, num_generated: int) -> float:
        return cumulative_logprob / (num_generated**self.length_penalty)

    def add(self, cumulative_logprob: float, token_ids: list[int], finished_by_stop: bool) -> None:
        score = self.penalised(cumulative_logprob, len(token_ids))
        if self.is_full and score <= self.hyps[-1].score:
            return
        hyp = Hypothesis(score, cumulative_logprob, token_ids, finished_by_stop)
        # after every existing hypothesis of an equal score (those were found first)
        pos = next((i for i, h in enumerate(self.hyps) if h.score < score), len(self.hyps))
        self.hyps.insert(pos, hyp)
        del self.hyps[self.num_beams :]

    @property
    def is_full(self) -> bool:
        return len(self.hyps) >= self.num_beams

    def cannot_improve(self, best_running: float, num_generated: int, max_new: int, early_stopping) -> bool:
        """HF's early-stop heuristic: the best running beam cannot beat the worst finished one."""
        if not self.is_full:
            return False
        if early_stopping == "never" and self.length_penalty > 0.0:
            length = max_new
        else:
            length = num_generated
        return best_running / (length**self.length_penalty) <= self.hyps[-1].score

    def reset(self) -> None:
        self.hyps.clear()
