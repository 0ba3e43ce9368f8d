"""One beam-search request: its live beams, their scores and the finished hypotheses.

Semantics follow HF ``generate(num_beams=k, do_sample=False)`` (transformers v5 ``_beam_search``):
each step the best ``num_keep`` = max(2, 1 + #stop ids) * k continuations over all beams are
ranked; those ending in a stop token (or reaching the length limit) among the first k become
finished hypotheses scored ``sum_logprobs / num_generated ** length_penalty``; the best k others
keep running. Without stop ids (catalog search) ``num_keep`` is k: no candidate can finish early.

The group decides; the scheduler moves KV. ``advance`` rewrites the beams' tokens and returns
which beams were dropped (free their blocks) and which new beams continue another beam's prefix
(fork: share its full blocks, copy its partial last block). Beam ``Request`` objects are reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xengine.beam.catalog import ItemCatalog
from xengine.request import Request, RequestStatus
from xengine.sampling.beam_search import BeamHypotheses, BeamSelector, Hypothesis


@dataclass
class BeamStep:
    done: bool
    dropped: list[Request] = field(default_factory=list)
    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (parent, child)


class BeamGroup:
    def __init__(
        self, root: Request, eos_token_ids: set[int], max_new_tokens: int, catalog: ItemCatalog | None
    ) -> None:
        params = root.params
        self.req_id = root.req_id
        self.root = root
        self.width = params.beam_width
        self.catalog = catalog
        self.early_stopping = params.early_stopping
        if catalog is not None:
            self.stop_token_ids: set[int] = set()
            self.max_new_tokens = catalog.item_len
        else:
            self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
            self.max_new_tokens = max_new_tokens
        ratio = max(2, 1 + len(self.stop_token_ids)) if self.stop_token_ids else 1
        self.num_keep = ratio * self.width
        self.num_candidates = params.beam_top_k or self.num_keep
        self.banned_while_short = sorted(self.stop_token_ids)  # until min_tokens are generated
        self.selector = BeamSelector(self.num_keep)
        self.hyps = BeamHypotheses(self.width, params.length_penalty)
        self.slots: list[Request] = [root]  # live beams, best first
        self.scores: list[float] = [0.0]  # cumulative logprob per live beam
        self._spare: list[Request] = []
        self._num_slots_made = 1
        self.num_generated = 0
        self.epoch = 0  # bumped by reset (preemption)

    # ------------------------------------------------------------------ per-step inputs
    def allowed_token_ids(self, beam: Request) -> np.ndarray | None:
        if self.catalog is None:
            return None
        return self.catalog.allowed_token_ids(beam.output_token_ids)

    def banned_token_ids(self, beam: Request) -> list[int]:
        return self.banned_while_short if len(beam.output_token_ids) < beam.params.min_tokens else []

    # ------------------------------------------------------------------ step
    def advance(self, cand_logprobs: list[list[float]], cand_token_ids: list[list[int]]) -> BeamStep:
        """Apply one step's candidates (per live beam, sorted descending)."""
        num = self.selector.select(self.scores, cand_logprobs, cand_token_ids)
        sel = self.selector
        num_generated = self.num_generated + 1
        at_max = num_generated >= self.max_new_tokens
        running: list[tuple[int, int, float]] = []  # (parent beam, token, score)
        num_hits = 0
        for i in range(num):
            score, beam, token_id = sel.scores[i], sel.beam_indices[i], sel.token_ids[i]
            is_stop = token_id in self.stop_token_ids
            if is_stop or at_max:
                num_hits += 1
                if i < self.width:
                    tokens = self.slots[beam].output_token_ids + [token_id]
                    self.hyps.add(score, tokens, is_stop)
            elif len(running) < self.width:
                running.append((beam, token_id, score))
        self.num_generated = num_generated
        if self._is_done(running, num_hits == num):
            return BeamStep(done=True)
        return self._rebuild(running)

    def _is_done(self, running: list[tuple[int, int, float]], all_hit: bool) -> bool:
        if not running or all_hit:
            return True
        if self.early_stopping is True and self.hyps.is_full:
            return True
        return self.hyps.cannot_improve(
            running[0][2], self.num_generated, self.max_new_tokens, self.early_stopping
        )

    def _rebuild(self, running: list[tuple[int, int, float]]) -> BeamStep:
        """New live beams from ``running``; the first child of a beam continues in place."""
        children: dict[int, list[int]] = {}
        for i, (beam, _, _) in enumerate(running):
            children.setdefault(beam, []).append(i)
        step = BeamStep(done=False)
        step.dropped = [s for b, s in enumerate(self.slots) if b not in children]
        free = step.dropped + self._spare
        new_slots: list[Request | None] = [None] * len(running)
        new_tokens: list[list[int] | None] = [None] * len(running)
        for beam, idxs in children.items():
            parent = self.slots[beam]
            new_slots[idxs[0]] = parent
            for i in idxs[1:]:
                child = free.pop() if free else self._new_slot()
                new_tokens[i] = list(parent.output_token_ids)
                new_slots[i] = child
                step.forks.append((parent, child))
        for i, (slot, (_, token_id, _)) in enumerate(zip(new_slots, running)):
            assert slot is not None
            if new_tokens[i] is not None:
                slot.output_token_ids = new_tokens[i]
            slot.output_token_ids.append(token_id)
        self._spare = free
        self.slots = new_slots  # type: ignore[assignment]
        self.scores = [score for _, _, score in running]
        return step

    def _new_slot(self) -> Request:
        root = self.root
        slot = Request(
            seq_id=f"{root.req_id}#beam{self._num_slots_made}",
            req_id=root.req_id,
            index=0,
            prompt_token_ids=root.prompt_token_ids,
            params=root.params,
            priority=root.priority,
            arrival_time=root.arrival_time,
            num_cached_tokens=root.num_cached_tokens,
            status=RequestStatus.FINISHED,  # until the scheduler forks KV into it
            admitted_once=True,
        )
        self._num_slots_made += 1
        return slot

    # ------------------------------------------------------------------ end / restart
    def results(self) -> list[Hypothesis]:
        """The best ``n`` finished sequences, best first."""
        return self.hyps.hyps[: self.root.params.n]

    def reset(self) -> Request:
        """Back to the initial state (preempted: every beam's KV was dropped); returns the root."""
        root = self.root
        for slot in self.slots + self._spare:
            slot.status = RequestStatus.FINISHED
        self._spare = [s for s in self.slots + self._spare if s is not root]
        root.output_token_ids = []
        root.num_computed_tokens = 0
        self.slots = [root]
        self.scores = [0.0]
        self.hyps.reset()
        self.num_generated = 0
        self.epoch += 1
        return root
