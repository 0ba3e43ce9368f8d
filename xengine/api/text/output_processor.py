"""Per-request output state: engine deltas in, detokenized and stop-string-checked text out.

Shared by the offline ``LLM`` API and the HTTP service. One ``RequestOutputState`` per request
tracks its ``n`` sequences independently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xengine.api.messages import CompletionDelta, PromptLogprobs, SamplingParams
from xengine.api.text.detokenizer import IncrementalDetokenizer
from xengine.api.text.stop import StopStringMatcher
from xengine.api.text.tokenizer import Tokenizer

TopLogprobs = list[list[tuple[int, float]]]


@dataclass
class SeqOutput:
    """One sequence (``index`` < n) of a request, cumulative."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: TopLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass
class PromptLogprobsOutput:
    """Logprobs of prompt tokens 1, 2, ... (token 0 has none), as the engine reported them so far."""

    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # rank of each prompt token (1: the most likely)
    top_logprobs: TopLogprobs = field(default_factory=list)

    def extend(self, chunk: PromptLogprobs) -> None:
        """Append ``chunk``'s positions past those held (a request re-run elsewhere repeats them)."""
        end = len(self.logprobs) + 1
        if chunk.start > end:
            raise ValueError(f"prompt logprobs from position {chunk.start}, expected {end}")
        skip = end - chunk.start
        self.logprobs.extend(chunk.logprobs[skip:])
        self.ranks.extend(chunk.ranks[skip:])
        self.top_logprobs.extend([(t.token_id, t.logprob) for t in alts] for alts in chunk.top[skip:])


@dataclass
class SeqDelta:
    """What changed in one sequence on one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: TopLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _SeqState:
    """Detokenizer, stop matcher and cumulative output of one sequence."""

    def __init__(self, index: int, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: list[int]):
        want_logprobs = params.logprobs is not None
        self.out = SeqOutput(
            index, logprobs=[] if want_logprobs else None, top_logprobs=[] if want_logprobs else None
        )
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self.matcher = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        )
        self.include_stop_token = params.include_stop_str_in_output
        self.engine_finished = False
        self.stopped_here = False  # stopped by a stop string (the engine may still be running it)

    def apply(self, delta: CompletionDelta) -> SeqDelta:
        """Consume one engine delta for this sequence (which must not be finished yet)."""
        ids = list(delta.new_token_ids)
        logprobs = list(delta.new_logprobs) if delta.new_logprobs is not None else None
        tops = [[(t.token_id, t.logprob) for t in alts] for alts in delta.new_top_logprobs or []] or None
        stop_token_ended = (
            delta.finish_reason == "stop"
            and isinstance(delta.stop_reason, int)
            and ids[-1:] == [delta.stop_reason]
        )
        text_ids = ids[:-1] if stop_token_ended and not self.include_stop_token else ids
        text, kept, matched = self._detokenize(text_ids)
        if matched is None and delta.finish_reason is not None:
            tail, matched = self._flush()
            text, kept = text + tail, len(ids)
        if matched is not None:
            ids, finish, reason = ids[:kept], "stop", matched
        else:
            finish, reason = delta.finish_reason, delta.stop_reason
        logprobs = logprobs[: len(ids)] if logprobs is not None else None
        tops = tops[: len(ids)] if tops is not None else None
        self._record(text, ids, logprobs, tops, finish, reason)
        self.engine_finished = delta.finish_reason is not None
        self.stopped_here = matched is not None
        return SeqDelta(self.out.index, text, ids, logprobs, tops, finish, reason)

    def _detokenize(self, ids: list[int]) -> tuple[str, int, str | None]:
        """(text to emit, number of ids kept, matched stop string). Token by token when stop strings
        are set, so the token that completed a stop string is known."""
        if self.matcher is None:
            return self.detok.add(ids), len(ids), None
        pieces = []
        for i, token_id in enumerate(ids):
            emit, matched = self.matcher.feed(self.detok.add([token_id]))
            pieces.append(emit)
            if matched is not None:
                return "".join(pieces), i + 1, matched
        return "".join(pieces), len(ids), None

    def _flush(self) -> tuple[str, str | None]:
        """Held-back text at the end of the sequence, and a stop string it completed (if any)."""
        tail = self.detok.flush()
        if self.matcher is None:
            return tail, None
        emit, matched = self.matcher.feed(tail)
        return emit + self.matcher.flush(), matched

    def _record(
        self,
        text: str,
        ids: list[int],
        logprobs: list[float] | None,
        tops: TopLogprobs | None,
        finish: str | None,
        reason: int | str | None,
    ) -> None:
        out = self.out
        out.text += text
        out.token_ids.extend(ids)
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.extend(logprobs)
        if out.top_logprobs is not None and tops is not None:
            out.top_logprobs.extend(tops)
        out.finish_reason, out.stop_reason = finish, reason


class RequestOutputState:
    """State machine of one request's outputs: ``process()`` each engine delta as it arrives."""

    def __init__(
        self, req_id: str, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]
    ):
        self.req_id = req_id
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self._seqs = [_SeqState(i, tokenizer, params, prompt_token_ids) for i in range(params.n)]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.error: str | None = None
        want_prompt = params.prompt_logprobs is not None
        self.prompt_logprobs: PromptLogprobsOutput | None = PromptLogprobsOutput() if want_prompt else None
        self.embedding: list[float] | None = None  # pooling requests

    @property
    def outputs(self) -> list[SeqOutput]:
        """Cumulative output of every sequence, by index."""
        return [seq.out for seq in self._seqs]

    @property
    def finished(self) -> bool:
        """All ``n`` sequences have a finish reason."""
        return all(seq.out.finish_reason is not None for seq in self._seqs)

    @property
    def needs_abort(self) -> bool:
        """Every sequence the engine is still running was stopped here by a stop string: abort it."""
        running = [seq for seq in self._seqs if not seq.engine_finished]
        return bool(running) and all(seq.stopped_here for seq in running)

    def process(self, delta: CompletionDelta) -> SeqDelta | None:
        """Apply one engine delta; None when it changes nothing (e.g. its sequence already stopped)."""
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        if delta.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(delta.prompt_logprobs)
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.error is not None:
            return self._fail(delta)
        if not 0 <= delta.index < len(self._seqs):
            raise ValueError(
                f"request {self.req_id}: delta index {delta.index} out of range (n={len(self._seqs)})"
            )
        seq = self._seqs[delta.index]
        if seq.out.finish_reason is not None:
            seq.engine_finished = seq.engine_finished or delta.finish_reason is not None
            return None
        if not delta.new_token_ids and delta.finish_reason is None:
            return None
        return seq.apply(delta)

    def _fail(self, delta: CompletionDelta) -> SeqDelta | None:
        """The engine reported an error: every unfinished sequence ends with finish_reason "error"."""
        self.error = delta.error
        in_range = 0 <= delta.index < len(self._seqs)
        was_open = in_range and self._seqs[delta.index].out.finish_reason is None
        for seq in self._seqs:
            seq.engine_finished = True
            if seq.out.finish_reason is None:
                seq.out.finish_reason = "error"
        return SeqDelta(delta.index, "", [], finish_reason="error") if was_open else None
