"""``/v1/responses``: OpenAI's Responses API, stateless, over the chat machinery.

The input becomes chat messages rendered by the model's template (tools included; images loaded as
chat's), one engine request runs, and its text becomes output items
(``responses_events.ResponseBuilder``): streamed as OpenAI's named events, or returned as one
response object.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xengine.api.messages import SamplingParams, StructuredOutputsParams
from xservice.http.errors import InvalidRequestError, NotFoundError, from_value_error
from xservice.protocol import dump
from xservice.protocol.responses import ResponseObject, ResponsesRequest, ResponseUsage
from xservice.serving.chat_render import chat_render
from xservice.serving.context import ServingContext, new_request_id
from xservice.serving.generation import Generation
from xservice.serving.params import resolve_max_tokens
from xservice.serving.prompts import chat_prompt
from xservice.serving.responses_events import ResponseBuilder, usage_of
from xservice.serving.responses_input import (
    functions_of,
    input_messages,
    responses_param,
    text_constraint,
    tool_choice_of,
)
from xservice.serving.streaming import (
    ClientDisconnected,
    disconnected_response,
    run_until_disconnected,
    sse_response,
)
from xservice.serving.text_workers import INLINE_MAX_COST
from xservice.serving.tools.plan import ToolPlan, plan_tools

_RENAME = {"max_tokens": "max_output_tokens", "structured_outputs": "text.format"}


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _sampling_params(
    body: ResponsesRequest,
    max_tokens: int,
    plan: ToolPlan,
    vocab_size: int,
    structured: StructuredOutputsParams | None,
) -> SamplingParams:
    """``structured``: ``text_constraint(body.text)``, checked off the event loop by the caller."""
    if structured is not None and plan.structured is not None:
        raise InvalidRequestError(
            "'text.format' cannot be combined with tool calls that constrain the output "
            "('tool_choice' \"required\", a named tool, or 'strict' tools).",
            param="text.format",
        )
    params = SamplingParams(
        temperature=_or(body.temperature, 1.0),
        top_p=_or(body.top_p, 1.0),
        top_k=_or(body.top_k, 0),
        min_p=_or(body.min_p, 0.0),
        repetition_penalty=_or(body.repetition_penalty, 1.0),
        seed=body.seed,
        max_tokens=max_tokens,
        structured_outputs=structured or plan.structured,
    )
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise from_value_error(exc, _RENAME) from None
    return params


def _initial_response(
    body: ResponsesRequest, resp_id: str, model: str, params: SamplingParams
) -> ResponseObject:
    """The response object before any output: the request's settings echoed, as OpenAI does."""
    fmt = body.text.format if body.text is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True)} if fmt is not None else None
    choice = body.tool_choice
    return ResponseObject(
        id=resp_id,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=model,
        parallel_tool_calls=body.parallel_tool_calls,
        temperature=params.temperature,
        top_p=params.top_p,
        tool_choice=choice.model_dump()
        if choice is not None and not isinstance(choice, str)
        else (choice or "auto"),
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
        **({"text": text} if text else {}),
    )


async def create_response(ctx: ServingContext, body: ResponsesRequest, request: Request) -> Response:
    """Validate, admit and run a Responses API request."""
    arrival = time.monotonic()
    lora_name = ctx.check_model(body.model)
    resp_id = new_request_id("resp")
    conversation = input_messages(body, takes_images=ctx.images is not None)
    render = await chat_render(ctx, chat_template_kwargs=body.chat_template_kwargs)
    functions = functions_of(body)
    plan = await ctx.text.run(  # on a worker with tools: their schemas are copied and may be compiled
        INLINE_MAX_COST + 1 if functions else 0,
        plan_tools,
        functions,
        tool_choice_of(body),
        body.parallel_tool_calls,
        ctx.tool_family,
        render.template_vars,
        responses_param,
    )
    prompt = await chat_prompt(
        ctx, conversation.messages, True, render=render.with_tools(plan.tools), where=conversation.where
    )
    max_tokens = resolve_max_tokens(
        body.max_output_tokens,
        len(prompt.ids),
        ctx.max_model_len,
        default=None,
        param="max_output_tokens",
        where="input",
    )
    structured = await asyncio.to_thread(text_constraint, body.text) if body.text is not None else None
    params = _sampling_params(body, max_tokens, plan, ctx.vocab_size, structured)
    params.lora_name = lora_name
    gen = Generation(ctx, resp_id, prompt.ids, params, rename=_RENAME, arrival=arrival)
    gen.images = prompt.images or None
    builder = ResponseBuilder(
        _initial_response(body, resp_id, lora_name or ctx.model_name, params), plan.new_parser()
    )
    ticket = ctx.admit()
    if body.stream:
        return sse_response(_stream(gen, builder), ticket, ctx.metrics, named=True)
    try:
        await run_until_disconnected(request, gen.collect())
    except ClientDisconnected:
        return disconnected_response()
    finally:
        ticket.release()
    out = gen.outputs[0]
    builder.text(out.text)
    builder.finish(out.finish_reason, _usage(gen))
    return JSONResponse(dump(builder.response))


def _usage(gen: Generation) -> ResponseUsage:
    return usage_of(len(gen.prompt_ids), gen.num_completion_tokens, gen.state.num_cached_tokens)


async def _stream(gen: Generation, builder: ResponseBuilder) -> AsyncIterator[dict[str, Any]]:
    for event in builder.start():
        yield event
    async for delta in gen.stream():
        for event in builder.text(delta.text):
            yield event
        if delta.finish_reason is not None:
            for event in builder.finish(delta.finish_reason, _usage(gen)):
                yield event


def not_stored(response_id: str) -> NotFoundError:
    """The answer to every request for a stored response: there are none."""
    return NotFoundError(
        f"Response '{response_id}' not found: this server does not store responses "
        "(every /v1/responses request is stateless; 'store' has no effect).",
        param="response_id",
    )
