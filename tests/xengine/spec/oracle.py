"""Proposers for tests: one drafts a known continuation of each prompt with some drafts corrupted
(seeded), so full accepts, partial accepts and rejections at the first draft all happen on any model;
one records what a model proposer drafts while another decides what is verified."""

from __future__ import annotations

import random
from typing import Any

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


class RecordingProposer:
    """A model proposer (``inner``) runs as it would (its KV, its drafts); ``verified`` decides what the
    target verifies (None: ``inner``'s drafts themselves). Every draft ``inner`` made is recorded with
    the tokens it continued."""

    def __init__(self, inner: Any, verified: OracleProposer | None = None) -> None:
        self.inner, self.verified = inner, verified
        self.seen: dict[tuple[int, ...], list[int]] = {}
        self.truncated = 0  # drafts of a head that starts past the sequence's first pair (not in seen)

    def prepare(self, reqs: list[Request], ks: list[int]) -> None:
        self.inner.prepare(reqs, ks)

    def propose(self, req: Request, k: int) -> list[int]:
        drafts = self.inner.propose(req, k)
        if drafts and getattr(self.inner, "bases", {}).get(req.seq_id, 0):
            self.truncated += 1
        elif drafts:
            self.seen[tuple(req.all_token_ids)] = drafts
        return self.verified.propose(req, k) if self.verified is not None else drafts

    def release(self, seq_id: str) -> None:
        self.inner.release(seq_id)

    def finish(self, req: Request) -> None:
        finish = getattr(self.inner, "finish", None)
        if finish is not None:
            finish(req)
        else:
            self.inner.release(req.seq_id)


def run_with_oracle(
    llm: Any, prompts: list[list[int]], expected: list[list[int]], params: Any
) -> RecordingProposer:
    """Generate ``prompts`` twice (the second run meets a warm prefix cache) with ``llm``'s model proposer
    running and an oracle over ``expected`` deciding what is verified; every output must be ``expected``,
    and the drafts verified must have been partly accepted. Returns the recording."""
    drafter = llm.engine.scheduler.drafter
    oracle = OracleProposer({tuple(p): e for p, e in zip(prompts, expected)}, llm.engine.vocab_size)
    drafter.proposer = rec = RecordingProposer(drafter.proposer, oracle)
    for run in range(2):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected, f"run {run}"
    assert 0 < drafter.stats.num_accepted_tokens < drafter.stats.num_draft_tokens
    return rec
