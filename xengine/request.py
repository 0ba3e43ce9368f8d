"""Engine-side request state: one ``Request`` per sequence (``n > 1`` forks children)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xengine.api.image_keys import salted_key
from xengine.api.messages import PoolingParams, Priority, PromptLogprobs, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from xengine.multimodal.request_images import RequestImages
    from xengine.structured.backend import BaseCompiledGrammar

PRIORITY_RANK = {"online": 0, "offline": 1}  # lower runs first


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    seq_id: str  # unique per sequence: "<req_id>" for index 0, "<req_id>#<i>" for forks
    req_id: str  # the client's request id, shared by the n sequences
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = "online"
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    status: RequestStatus = RequestStatus.WAITING
    num_pending_forks: int = 0  # n - 1 until the first token is sampled
    generator: object | None = None  # torch.Generator for seeded sampling (set by the runner)
    # not yet reported to the client
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it failed (finish_reason "error")
    num_preemptions: int = 0
    admitted_once: bool = False
    num_placeholders: int = 0  # async scheduling: output tokens of steps still in flight
    received_at: float = field(default_factory=time.monotonic)  # when the engine got it
    queue_time_s: float | None = None  # received -> first scheduled; None once reported
    started_at: float | None = None  # when the first step computing it started running
    arrived_during_offline: bool = False  # online, read while an offline prefill step ran
    # structured outputs: the compiled grammar (set once compiled; its matchers live in the runner)
    grammar: BaseCompiledGrammar | None = None
    # beam search results only (set on the per-sequence outputs of a finished beam group)
    beam_score: float | None = None
    cumulative_logprob: float | None = None
    # prompt-side outputs (``xengine/runner/prompt_outputs.py``)
    pooling: PoolingParams | None = None  # an embedding request
    prompt_logprobs_end: int = 1  # prompt logprobs of positions [1, end) are reported (or pending)
    new_prompt_logprobs: PromptLogprobs | None = None  # not yet reported
    embedding: list[float] | None = None  # the pooled vector, once the prompt is computed
    # images whose pad tokens the prompt holds (vision-language models): positions, prefix-cache keys
    mm: RequestImages | None = None
    encode_only: bool = False  # EPD: encode the images, finish "encoded" (``encode_stage.py``)
    # vLLM's ``prompt_embeds``: the prompt's embeddings ([tokens, hidden] tensor; ``prompt_token_ids`` are
    # placeholders) and their content key, which keys the prefix cache
    prompt_embeds: Any = None
    embeds_key: str | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and some still to compute: its prompt must not come from the
        prefix cache past ``prompt_logprobs_end - 1`` (cached positions have no hidden states)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs_end < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def cache_token_ids(self) -> list[int]:
        """The tokens as the prefix cache keys them: image pads stand for their image's content."""
        keys = self.prompt_token_ids if self.mm is None else self.mm.cache_prompt_ids
        lora, salt = self.params.lora_name, self.params.cache_salt
        if self.embeds_key is not None:  # placeholder ids: the embeddings' content names the prefix
            salt = f"{salt!r}:embeds:{self.embeds_key}"
        if lora is not None or salt is not None:  # an adapter's KV is its own, a salt's is private
            keys = [salted_key(keys[0], lora, salt), *keys[1:]]
        return keys + self.output_token_ids

    @property
    def rank(self) -> tuple[int, float]:
        return (PRIORITY_RANK[self.priority], self.arrival_time)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
