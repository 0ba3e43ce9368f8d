"""Plain data passed scheduler -> runner -> scheduler each step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from xengine.api.messages import PromptLogprobs, TokenLogprob
from xengine.multimodal.encode_stage import EncodeJob
from xengine.request import Request


@dataclass(slots=True)  # built per sequence and step: slots, and no list made per default
class ScheduledSeq:
    req: Request
    num_new_tokens: int  # tokens computed this step, starting at req.num_computed_tokens
    sample: bool  # True when this step reaches the end of the known tokens: sample the next one
    num_samples: int = 1  # > 1 once, on the step that forks an n > 1 request
    # beam search: return the top ``num_beam_candidates`` (logprob, token) instead of sampling
    num_beam_candidates: int = 0
    banned_token_ids: Sequence[int] = ()  # beam rows: logprob -inf
    allowed_token_ids: np.ndarray | None = None  # beam rows constrained by a catalog trie
    # async scheduling (``xengine/scheduler/in_flight.py``): set when the request was advanced at
    # schedule time, as if this step had already run
    computed_after: int | None = None  # num_computed_tokens once this step ran
    output_index: int | None = None  # where this step's token sits in output_token_ids (a placeholder)
    # speculative decoding (``xengine/spec/``): draft tokens computed after the sequence's last token
    # (counted in ``num_new_tokens``); the step verifies them and samples up to len + 1 tokens
    draft_token_ids: Sequence[int] = ()

    @property
    def end(self) -> int:
        """Position after this step's last token (its sequence length once the step ran)."""
        return (
            self.computed_after
            if self.computed_after is not None
            else self.req.num_computed_tokens + self.num_new_tokens
        )

    @property
    def start(self) -> int:
        """Position of this step's first token."""
        return self.end - self.num_new_tokens


@dataclass
class SchedulePlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # seq_id -> block ids
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # the sliding-window layers' tables and copies when they have a pool of their own (None: they
    # read ``block_tables`` like every layer)
    window_block_tables: dict[str, list[int]] | None = None
    window_block_copies: list[tuple[int, int]] = field(default_factory=list)
    # recurrent layers (``memory/recurrent_state.py``): each sequence's state slot, the snapshots to
    # write this step (seq_id -> [(position, snapshot slot)]) and the slot copies to run before it
    # (prefix hits, forks); None / empty for a model without recurrent layers
    state_slots: dict[str, int] | None = None
    state_checkpoints: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_seq_ids: list[str] = field(default_factory=list)
    # async scheduling: the next step must not be scheduled before this one's outputs are applied
    # (forks of n > 1 requests, beam search steps)
    sync: bool = False
    # only offline work with a prefill chunk: an online arrival may stop it between layers
    # (``xengine/colocation/``); nothing of it applies then
    interruptible: bool = False
    encodes: list[EncodeJob] = field(default_factory=list)  # images to encode (``encode_stage.py``)
    # every sequence computes one known token past its prompt and samples one token after it: no
    # prompt chunk, draft, beam row or fork (``xengine/runner/decode_inputs.py`` builds its inputs)
    decode_only: bool = False
    # the KV tokens its sequences attend once it ran, counted by the scheduler while planning (None:
    # ``token_counts`` adds them up)
    context_tokens: int | None = None

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.encodes

    def token_counts(self) -> tuple[int, int]:
        """``(context_tokens, prefill_tokens)`` of this step, for performance models: the KV tokens
        its sequences attend (the sum of their lengths once it ran) and the tokens it computes beyond
        one per decoding sequence (a decoding sequence computes exactly one token past its prompt;
        prompt chunks, one-token prompts and recomputation after preemption count as prefill).
        Call it before ``scheduler.update`` applies the step (``end`` of a sequence not advanced at
        schedule time is read off its ``num_computed_tokens``)."""
        if self.decode_only:
            context = self.context_tokens
            return (sum(s.end for s in self.seqs) if context is None else context), 0
        context = prefill = 0
        for s in self.seqs:
            end = s.end
            context += end
            if s.num_new_tokens != 1 or end <= s.req.num_prompt_tokens:
                prefill += s.num_new_tokens
        return context, prefill


class StepSample(NamedTuple):
    """One step that ran, for the instance's performance model (``keys.LoadReport.steps``)."""

    num_seqs: int
    context_tokens: int
    prefill_tokens: int
    step_s: float  # the time the step took as the engine's caller sees it (see ``StepTiming``)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None


@dataclass
class StepOutput:
    """Per scheduled sequence that sampled: ``num_samples`` tokens (normally one)."""

    # the common step, every sampling row a sequence's only token and no logprobs: seq_id -> token
    # id, from one ``dict(zip(...))`` (``ModelRunner._collect``); ``sampled`` is built from it on
    # first use. At most one of the two is set: whichever was written last holds the step's tokens.
    token_ids: dict[str, int] | None = None
    _sampled: dict[str, list[SampledToken]] | None = field(default=None, repr=False)
    # beam rows: seq_id -> (logprobs, token ids) of its top candidates, logprob descending
    beam_candidates: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    forward_s: float = 0.0  # model forward + logits time of this step
    sample_s: float = 0.0  # the sampler's time (device work: on a GPU / NPU it runs there)
    prepare_s: float = 0.0  # the host's inputs of the step (``ModelRunner.prepare``), when run together
    # the sampled token of every sampling row, in row order (async scheduling resolves the next
    # step's placeholders from it); None when nothing was sampled
    sampled_rows: torch.Tensor | None = None
    # prompt-side outputs (``xengine/runner/prompt_outputs.py``): seq_id -> the prompt logprobs this
    # step computed / the pooled embedding of a prompt this step completed
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    @property
    def sampled(self) -> dict[str, list[SampledToken]]:
        """Per sequence that sampled: its tokens in order (a fork's siblings and verified drafts
        give several), with logprobs when asked."""
        if self._sampled is None:
            ids, self.token_ids = self.token_ids, None
            self._sampled = {} if ids is None else {s: [SampledToken(t)] for s, t in ids.items()}
        return self._sampled
