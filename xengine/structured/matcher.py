"""Per-sequence matcher state, and the constrained rows of one step.

The runner owns one matcher per sequence, keyed by ``seq_id`` like its seeded generators. Matchers
are looked up (or created) on the engine thread when a step is prepared and used on whichever thread
runs the step: the bitmask is filled right before sampling and the sampled tokens accepted right
after, so with async scheduling step t+1's mask always sees token t (steps run one after another on
the worker). An ``n > 1`` request's other sequences get their matchers on the step that forks them:
that is the request's first sampled token, so a fresh matcher is exactly the parent's state.
Preemption (recompute) drops KV, not the parse state: the matcher stays with the sequence; finishing
or aborting the sequence releases it. A request resumed on this instance after tokens generated
elsewhere (PD hand-off, migration: they are the tail of its prompt) gets matchers already past them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from xengine.structured.backend import BaseCompiledGrammar, BaseGrammarMatcher
from xengine.structured.bitmask import allocate_bitmask

logger = logging.getLogger(__name__)


@dataclass
class GrammarRows:
    """Which rows of a step's sampling batch are constrained, and their sequences' matchers."""

    rows: list[int] = field(default_factory=list)
    matchers: list[BaseGrammarMatcher] = field(default_factory=list)
    num_ids: int = 0  # bitmask width in ids (the widest grammar of the step)
    # speculative decoding: per row, the draft token its sequence's next row follows (None: the
    # sequence's last row); ``fill_bitmask`` advances through it and rolls back afterwards
    drafts: list[int | None] = field(default_factory=list)

    def add(self, row: int, matcher: BaseGrammarMatcher, num_ids: int, draft: int | None = None) -> None:
        """Constrain ``row`` by ``matcher``'s state; ``draft``: the next row is the same sequence's
        after this draft token (rows of one sequence are added in order)."""
        self.rows.append(row)
        self.matchers.append(matcher)
        self.drafts.append(draft)
        self.num_ids = max(self.num_ids, num_ids)

    def fill_bitmask(self) -> torch.Tensor:
        """int32 ``[len(rows), ceil(num_ids / 32)]``: row i is the mask of ``rows[i]``. A drafting
        sequence's rows see its drafts accepted one by one; its matcher is back where it was after."""
        bitmask = allocate_bitmask(len(self.rows), self.num_ids)
        advanced: dict[int, tuple[BaseGrammarMatcher, int]] = {}
        for i, (matcher, draft) in enumerate(zip(self.matchers, self.drafts)):
            matcher.fill_bitmask(bitmask, i)
            if draft is not None and matcher.accept_token(draft):
                _, n = advanced.get(id(matcher), (matcher, 0))
                advanced[id(matcher)] = (matcher, n + 1)
        for matcher, n in advanced.values():
            matcher.rollback(n)
        return bitmask

    def accept(self, sampled_token_ids: list[int]) -> None:
        """Advance each matcher past its row's sampled token (``sampled_token_ids``: every row's;
        -1: a drafting sequence's row past its last emitted token, nothing to accept)."""
        for row, matcher in zip(self.rows, self.matchers):
            token = sampled_token_ids[row]
            if token < 0:
                continue
            if not matcher.accept_token(token):
                # only possible for a token sampled without the mask applying (a row whose every
                # allowed id was also banned) or one computed past the sequence's end (async)
                logger.debug("grammar rejected token %d; the sequence may only end now", token)


class ResumedGrammar(BaseCompiledGrammar):
    """A compiled grammar whose matchers start past ``token_ids``: the output a request resumed on
    this instance already has (``StructuredOutputsParams.resume_token_ids``). A token the grammar
    rejects leaves the matcher failed (only eos allowed), never a mask out of step with the text."""

    def __init__(self, grammar: BaseCompiledGrammar, token_ids: list[int]) -> None:
        self.grammar = grammar
        self.token_ids = list(token_ids)
        self.num_ids = grammar.num_ids

    def new_matcher(self) -> BaseGrammarMatcher:
        matcher = self.grammar.new_matcher()
        for token in self.token_ids:
            if not matcher.accept_token(token):
                logger.debug("grammar rejected resumed token %d; the sequence may only end now", token)
                break
        return matcher


def for_request(grammar: BaseCompiledGrammar, resume_token_ids: list[int] | None) -> BaseCompiledGrammar:
    """The grammar a request's sequences use: ``grammar``, resumed past ``resume_token_ids`` if any."""
    return ResumedGrammar(grammar, resume_token_ids) if resume_token_ids else grammar


class SequenceMatchers:
    """seq_id -> matcher of every running constrained sequence."""

    def __init__(self) -> None:
        self._matchers: dict[str, BaseGrammarMatcher] = {}

    def get(self, seq_id: str, grammar: BaseCompiledGrammar) -> BaseGrammarMatcher:
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            matcher = self._matchers[seq_id] = grammar.new_matcher()
        return matcher

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers
