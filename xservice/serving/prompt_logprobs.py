"""Prompt logprobs in the API's shapes: the echoed prompt in OpenAI's legacy completions ``logprobs``
(``echo`` + ``logprobs``: what lm-evaluation-harness scores loglikelihoods with), and vLLM's
``prompt_logprobs`` field (on each completions choice, at the top of a chat response).

The engine computes them while prefilling (``xengine/runner/prompt_outputs.py``); the first prompt
token has none (nothing precedes it): ``null`` in both shapes, as OpenAI and vLLM.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from xengine.api.text.output_processor import PromptLogprobsOutput
from xservice.http.errors import InvalidRequestError
from xservice.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs, SamplingRequest
from xservice.serving.logprobs import CompletionLogprobsBuilder, TokenText
from xservice.serving.params import num_logprobs

if TYPE_CHECKING:
    from xservice.serving.context import ServingContext


def check_prompt_logprobs(body: SamplingRequest, ctx: ServingContext) -> None:
    """400 naming ``prompt_logprobs`` when out of range (-1: the whole vocabulary, made a count here) or
    asked with ``stream`` (as vLLM: a streamed response has no place for them)."""
    limit = ctx.config.model.max_logprobs
    body.prompt_logprobs = num_logprobs(body.prompt_logprobs, "prompt_logprobs", limit, ctx.vocab_size)
    if body.prompt_logprobs is None:
        return
    if body.stream:
        raise InvalidRequestError(
            "'prompt_logprobs' is not available with stream=true; request it without streaming.",
            param="prompt_logprobs",
        )


def engine_prompt_logprobs(prompt_logprobs: int | None, echo_logprobs: int | None) -> int | None:
    """The engine's ``prompt_logprobs``: enough alternatives for both the ``prompt_logprobs`` field and
    the echoed prompt's ``top_logprobs`` (``echo_logprobs``: ``logprobs`` when echoing, else None)."""
    wanted = [k for k in (prompt_logprobs, echo_logprobs) if k is not None]
    return max(wanted) if wanted else None


def prompt_logprobs_field(
    token_text: TokenText, prompt_ids: list[int], logprobs: PromptLogprobsOutput, num_top: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, {id: logprob, rank, decoded_token} for the prompt
    token and the top ``num_top`` tokens at its position (the prompt token first)."""
    out: PromptLogprobs = [None]
    for token_id, lp, rank, tops in zip(
        prompt_ids[1:], logprobs.logprobs, logprobs.ranks, logprobs.top_logprobs
    ):
        entry = {token_id: PromptLogprob(logprob=_finite(lp), rank=rank, decoded_token=token_text(token_id))}
        for r, (t, v) in enumerate(tops[:num_top], start=1):
            entry.setdefault(t, PromptLogprob(logprob=_finite(v), rank=r, decoded_token=token_text(t)))
        out.append(entry)
    return out


def echo_logprobs(
    builder: CompletionLogprobsBuilder, prompt_ids: list[int], logprobs: PromptLogprobsOutput, num_top: int
) -> CompletionLogprobs:
    """The echoed prompt in OpenAI's legacy shape, from ``builder``'s offset on (the completion's
    tokens follow with the same builder): ``null`` logprob and top_logprobs for the first token."""
    first = builder.build(prompt_ids[:1], None, None)
    first.top_logprobs = [None]
    tops = [alts[:num_top] for alts in logprobs.top_logprobs]
    return concat(first, builder.build(prompt_ids[1:], logprobs.logprobs, tops))


def concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf (as the completion's logprobs)


def prompt_only_max_tokens(
    requested: int | None, scores_prompt: bool, prompt_len: int, max_model_len: int
) -> int | None:
    """0 for a request that only scores its prompt (``max_tokens: 0`` with ``echo`` or
    ``prompt_logprobs``, as OpenAI's legacy API and vLLM accept), after checking the prompt fits the
    context; None for any other request (its ``max_tokens`` is resolved as usual)."""
    if requested != 0 or not scores_prompt:
        return None
    if prompt_len > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, the prompt has "
            f"{prompt_len} tokens. Please reduce the length of the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    return 0
