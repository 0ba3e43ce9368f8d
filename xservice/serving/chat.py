"""``/v1/chat/completions``: messages → chat template → one engine request with ``n`` choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xengine.api.messages import MAX_LOGPROBS
from xservice.errors import InvalidRequestError
from xservice.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    Usage,
    dump,
)
from xservice.serving.context import ServingContext, new_request_id
from xservice.serving.generation import Generation
from xservice.serving.logprobs import TokenText, chat_logprobs
from xservice.serving.params import build_sampling_params, check_n, resolve_max_tokens
from xservice.serving.prompts import chat_prompt_ids
from xservice.serving.streaming import (
    ClientDisconnected,
    disconnected_response,
    run_until_disconnected,
    sse_response,
)

# Engine field -> chat API field, so a 400 names what the client sent.
_RENAME = {"logprobs": "top_logprobs"}


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"invalid value for 'top_logprobs': must be in [0, {MAX_LOGPROBS}], got {top}",
            param="top_logprobs",
        )
    if not body.logprobs:
        if top:
            raise InvalidRequestError("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        return None
    return top or 0


async def _generation(
    ctx: ServingContext, body: ChatCompletionRequest, req_id: str, arrival: float
) -> Generation:
    prompt_ids = await chat_prompt_ids(ctx, body.messages, body.add_generation_prompt)
    requested, param = body.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(
        requested, len(prompt_ids), ctx.max_model_len, default=None, param=param, where="messages"
    )
    params = build_sampling_params(
        body, max_tokens=max_tokens, logprobs=_num_logprobs(body), vocab_size=ctx.vocab_size, rename=_RENAME
    )
    return Generation(ctx, req_id, prompt_ids, params, body.priority, rename=_RENAME, arrival=arrival)


def _usage(gen: Generation) -> Usage:
    return Usage.of(len(gen.prompt_ids), gen.num_completion_tokens, gen.state.num_cached_tokens)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    """Validate, admit and run a chat completions request."""
    arrival = time.monotonic()
    ctx.check_model(body.model)
    check_n(body.n, ctx.config.service.max_n)
    req_id = new_request_id("chatcmpl")
    gen = await _generation(ctx, body, req_id, arrival)
    ticket = ctx.admit()
    if body.stream:
        return sse_response(_stream(ctx, body, gen), ticket, ctx.metrics)
    try:
        await run_until_disconnected(request, gen.collect())
    except ClientDisconnected:
        return disconnected_response()
    finally:
        ticket.release()
    return JSONResponse(dump(_response(ctx, body, gen)))


def _response(ctx: ServingContext, body: ChatCompletionRequest, gen: Generation) -> ChatCompletionResponse:
    token_text = TokenText(ctx.tokenizer)
    num_top = body.top_logprobs or 0
    choices = []
    for out in gen.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(token_text, out.token_ids, out.logprobs, out.top_logprobs, num_top)
        choices.append(
            ChatChoice(
                index=out.index,
                message=ChatResponseMessage(content=out.text),
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
        )
    return ChatCompletionResponse(id=gen.req_id, model=ctx.model_name, choices=choices, usage=_usage(gen))


async def _stream(
    ctx: ServingContext, body: ChatCompletionRequest, gen: Generation
) -> AsyncIterator[dict[str, Any]]:
    """Chunk dicts: a role chunk per choice, then content deltas, then (optionally) usage."""

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        return dump(ChatCompletionChunk(id=gen.req_id, model=ctx.model_name, choices=choices, usage=usage))

    token_text = TokenText(ctx.tokenizer)
    num_top = body.top_logprobs or 0
    for i in range(body.n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    async for delta in gen.stream():
        logprobs = None
        if body.logprobs and delta.token_ids:
            logprobs = chat_logprobs(token_text, delta.token_ids, delta.logprobs, delta.top_logprobs, num_top)
        if not delta.text and delta.finish_reason is None and logprobs is None:
            continue
        choice = ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(content=delta.text or None),
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        yield chunk([choice])
    if body.include_usage:
        yield chunk([], usage=_usage(gen))
