"""A proposer for tests: drafts a known continuation of each prompt with some drafts corrupted (seeded),
so full accepts, partial accepts and rejections at the first draft all happen on any model."""

from __future__ import annotations

import random

from xengine.request import Request


class OracleProposer:
    """Drafts ``reference[prompt]`` from where the sequence stands; about ``wrong`` of the drafts are
    replaced by the next token id (seeded by the prompt's length and the position)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int, wrong: float = 0.3) -> None:
        self.reference, self.vocab, self.wrong = reference, vocab, wrong

    def propose(self, req: Request, k: int) -> list[int]:
        done = len(req.output_token_ids)
        out = list(self.reference[tuple(req.prompt_token_ids)][done : done + k])
        seed = len(req.prompt_token_ids) * 1000 + done * 10
        bad = [random.Random(seed + j).random() < self.wrong for j in range(len(out))]
        return [(t + 1) % self.vocab if b else t for t, b in zip(out, bad)]

    def release(self, seq_id: str) -> None:
        pass
