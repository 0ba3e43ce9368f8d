"""``/v1/chat/completions``: messages → chat template → one engine request with ``n`` choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xservice.http.errors import InvalidRequestError
from xservice.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    Usage,
    dump,
)
from xservice.protocol.common import PerRequestMetrics
from xservice.serving.chat_output import ChatOutput, chat_options
from xservice.serving.chat_render import ChatRender
from xservice.serving.context import ServingContext, new_request_id
from xservice.serving.generation import Generation
from xservice.serving.logprobs import TokenText, chat_logprobs
from xservice.serving.params import (
    apply_server_options,
    build_sampling_params,
    check_n,
    check_stream_options,
    num_logprobs,
    resolve_max_tokens,
)
from xservice.serving.prompt_logprobs import check_prompt_logprobs, prompt_logprobs_field
from xservice.serving.prompts import chat_prompt
from xservice.serving.reasoning.tokens import count_reasoning_tokens
from xservice.serving.request_metrics import request_metrics
from xservice.serving.slo import request_slo
from xservice.serving.sse_chunks import ChatChunks
from xservice.serving.streaming import (
    ClientDisconnected,
    disconnected_response,
    run_until_disconnected,
    sse_response,
)
from xservice.serving.structured import check_structured_outputs, constraint_rename
from xservice.serving.tools.plan import constrain
from xservice.serving.truncation import resolve_truncation

# Engine field -> chat API field, so a 400 names what the client sent.
_RENAME = {"logprobs": "top_logprobs"}


def _num_logprobs(ctx: ServingContext, body: ChatCompletionRequest) -> int | None:
    top = num_logprobs(body.top_logprobs, "top_logprobs", ctx.config.model.max_logprobs, ctx.vocab_size)
    body.top_logprobs = top  # -1 made the vocabulary's size: what the response lists
    if not body.logprobs:
        if top:
            raise InvalidRequestError("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        return None
    return top or 0


async def _generation(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    req_id: str,
    arrival: float,
    render: ChatRender,
    output: ChatOutput,
) -> Generation:
    prompt = await chat_prompt(
        ctx,
        body.messages,
        body.add_generation_prompt,
        add_special_tokens=body.add_special_tokens,
        truncation=resolve_truncation(body, ctx.max_model_len),
        render=render,
    )
    prompt_ids = prompt.ids
    requested, param = body.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, param = body.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(
        requested, len(prompt_ids), ctx.max_model_len, default=None, param=param, where="messages"
    )
    check_prompt_logprobs(body, ctx)
    await check_structured_outputs(body)  # the grammar sandbox, off the event loop
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=_num_logprobs(ctx, body),
        vocab_size=ctx.vocab_size,
        rename=_RENAME,
        prompt_logprobs=body.prompt_logprobs,
        tokenizer=ctx.tokenizer,
    )
    params = constrain(params, output.plan.structured)
    rename = {**_RENAME, **constraint_rename(body)}
    gen = Generation(ctx, req_id, prompt_ids, params, body.priority, rename=rename, arrival=arrival)
    gen.images = prompt.images or None
    return gen


def _usage(gen: Generation, reasoning_tokens: int | None = None) -> Usage:
    return Usage.of(
        len(gen.prompt_ids), gen.num_completion_tokens, gen.state.num_cached_tokens, reasoning_tokens
    )


async def _reasoning_tokens(ctx: ServingContext, gen: Generation, output: ChatOutput) -> int | None:
    """All choices' reasoning tokens (None without a reasoning parser: usage then has no details)."""
    if output.reasoning is None:
        return None
    skip = gen.params.skip_special_tokens

    async def decode(ids: list[int]) -> str:
        return await ctx.text.decode(ids, skip_special_tokens=skip)

    total = 0
    for out in gen.outputs:
        total += await count_reasoning_tokens(decode, list(out.token_ids), output.reasoning.span(out.text))
    return total


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    """Validate, admit and run a chat completions request."""
    arrival = time.monotonic()
    body._lora_name = ctx.check_model(body.model)
    check_n(body.n, ctx.config.service.max_n)
    check_stream_options(body)
    apply_server_options(
        body, ctx.config.service, ctx.config.structured_outputs.disable_additional_properties
    )
    req_id = new_request_id("chatcmpl")
    render, output = await chat_options(ctx, body)
    gen = await _generation(ctx, body, req_id, arrival, render, output)
    gen.slo = request_slo(body, request)
    ticket = ctx.admit()
    if body.stream:
        return sse_response(_stream(ctx, body, gen, output), ticket, ctx.metrics)
    try:
        await run_until_disconnected(request, gen.collect())
    except ClientDisconnected:
        return disconnected_response()
    finally:
        ticket.release()
    reasoning_tokens = await _reasoning_tokens(ctx, gen, output)
    return JSONResponse(dump(_response(ctx, body, gen, output, reasoning_tokens)))


def _response(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    gen: Generation,
    output: ChatOutput,
    reasoning_tokens: int | None = None,
) -> ChatCompletionResponse:
    token_text = TokenText(ctx.tokenizer, body.return_tokens_as_token_ids)
    num_top = None if body.logprob_token_ids else (body.top_logprobs or 0)
    choices = []
    for out in gen.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(token_text, out.token_ids, out.logprobs, out.top_logprobs, num_top)
        message, finish_reason = output.message(out.text, out.finish_reason)
        choices.append(
            ChatChoice(
                index=out.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=out.stop_reason,
                token_ids=out.token_ids if body.return_token_ids else None,
            )
        )
    prompt_ids = gen.prompt_ids if body.return_token_ids else None
    prompt_logprobs = None
    if body.prompt_logprobs is not None and gen.state.prompt_logprobs is not None:
        state = gen.state.prompt_logprobs
        prompt_logprobs = prompt_logprobs_field(token_text, gen.prompt_ids, state, body.prompt_logprobs)
    return ChatCompletionResponse(
        id=gen.req_id,
        model=body._lora_name or ctx.model_name,
        choices=choices,
        usage=_usage(gen, reasoning_tokens),
        prompt_token_ids=prompt_ids,
        prompt_logprobs=prompt_logprobs,
        metrics=request_metrics(ctx, [gen]),
    )


async def _stream(
    ctx: ServingContext, body: ChatCompletionRequest, gen: Generation, output: ChatOutput
) -> AsyncIterator[dict[str, Any] | str]:
    """Chunk dicts: a role chunk per choice (and the echoed text), then content and tool-call deltas,
    then (optionally) usage."""

    num_tokens = [0] * body.n  # per choice, for continuous usage

    def chunk(
        choices: list[ChatChunkChoice],
        index: int = 0,
        prompt_ids: list[int] | None = None,
        usage: Usage | None = None,
        metrics: PerRequestMetrics | None = None,
    ) -> dict[str, Any]:
        if usage is None and body.continuous_usage:  # choice ``index``'s usage so far
            usage = Usage.of(len(gen.prompt_ids), num_tokens[index], gen.state.num_cached_tokens)
        return dump(
            ChatCompletionChunk(
                id=gen.req_id,
                model=body._lora_name or ctx.model_name,
                choices=choices,
                usage=usage,
                prompt_token_ids=prompt_ids,
                metrics=metrics,
            )
        )

    token_text = TokenText(ctx.tokenizer, body.return_tokens_as_token_ids)
    num_top = None if body.logprob_token_ids else (body.top_logprobs or 0)
    # token chunks without ids or usage on them come encoded already (``sse_chunks.py``)
    plain = (
        None
        if body.return_token_ids or body.continuous_usage
        else ChatChunks(gen.req_id, body._lora_name or ctx.model_name)
    )
    for i in range(body.n):
        prompt_ids = gen.prompt_ids if body.return_token_ids and i == 0 else None  # on the first chunk
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))], i, prompt_ids)
    streams = [output.choice_stream() for _ in range(body.n)]
    for i, stream in enumerate(streams):
        content, calls, _ = stream.step(output.echo)
        if content or calls or stream.reasoning:
            delta = ChatDelta(content=content, tool_calls=calls, **_reasoning_fields(stream.reasoning))
            yield chunk([ChatChunkChoice(index=i, delta=delta)], i)
    async for delta in gen.stream():
        num_tokens[delta.index] += len(delta.token_ids)
        logprobs = None
        if body.logprobs and delta.token_ids:
            logprobs = chat_logprobs(token_text, delta.token_ids, delta.logprobs, delta.top_logprobs, num_top)
        shows_tokens = delta.token_ids and (body.return_token_ids or body.continuous_usage)
        stream = streams[delta.index]
        content, calls, finish_reason = stream.step(delta.text, delta.finish_reason)
        reasoning = stream.reasoning
        if (
            not (content or calls or reasoning)
            and finish_reason is None
            and logprobs is None
            and not shows_tokens
        ):
            continue
        if plain is not None and calls is None and reasoning is None and logprobs is None:
            yield plain.event(delta.index, content, finish_reason, delta.stop_reason)
            continue
        choice = ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(content=content, tool_calls=calls, **_reasoning_fields(reasoning)),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=list(delta.token_ids) if body.return_token_ids else None,
        )
        yield chunk([choice], delta.index)
    if body.include_usage:
        usage = _usage(gen, await _reasoning_tokens(ctx, gen, output))
        yield chunk([], usage=usage, metrics=request_metrics(ctx, [gen]))


def _reasoning_fields(text: str | None) -> dict[str, str | None]:
    """A delta's reasoning under both names (vLLM 0.33's ``reasoning``, the older ``reasoning_content``)."""
    return {"reasoning": text, "reasoning_content": text}
