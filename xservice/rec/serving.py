"""``POST /v1/rec/generate``: catalog-constrained beam search → the top items and their scores."""

from __future__ import annotations

import time

from fastapi import Request

from xengine.api.messages import AddRequest, CompletionDelta, SamplingParams
from xservice.engine.errors import EngineDeadError
from xservice.http.errors import EngineUnavailableError, InternalError, InvalidRequestError, from_value_error
from xservice.rec.catalogs import CatalogDirectory, not_found
from xservice.rec.protocol import RecGenerateRequest, RecGenerateResponse, RecItem, RecUsage
from xservice.serving.context import ServingContext, new_request_id
from xservice.serving.prompts import completion_prompts
from xservice.serving.streaming import ClientDisconnected, run_until_disconnected

MAX_TOP_K = 1024


def _check_widths(body: RecGenerateRequest, max_beam_width: int) -> tuple[int, int]:
    """(top_k, num_items) after defaults; 400 for out-of-range widths."""
    if not 1 <= body.beam_width <= max_beam_width:
        raise InvalidRequestError(
            f"invalid value for 'beam_width': must be in [1, {max_beam_width}], got {body.beam_width}",
            param="beam_width",
        )
    top_k = body.top_k if body.top_k is not None else body.beam_width
    if not 1 <= top_k <= MAX_TOP_K:
        raise InvalidRequestError(
            f"invalid value for 'top_k': must be in [1, {MAX_TOP_K}], got {top_k}", param="top_k"
        )
    num_items = body.num_items if body.num_items is not None else body.beam_width
    if not 1 <= num_items <= body.beam_width:
        raise InvalidRequestError(
            f"invalid value for 'num_items': must be in [1, beam_width={body.beam_width}], got {num_items}",
            param="num_items",
        )
    return top_k, num_items


async def rec_generate(
    ctx: ServingContext, directory: CatalogDirectory, body: RecGenerateRequest, request: Request
) -> RecGenerateResponse:
    lora_name = ctx.check_model(body.model)
    top_k, num_items = _check_widths(body, ctx.config.scheduler.max_beam_width)
    if isinstance(body.prompt, list) and not body.prompt:
        raise InvalidRequestError("The prompt must not be empty.", param="prompt")
    ((_, prompt_ids),) = await completion_prompts(ctx, body.prompt)
    ctx.check_engine()
    info = await directory.get(ctx.engine_client, body.catalog)
    if len(prompt_ids) + info.item_len > ctx.max_model_len:
        raise InvalidRequestError(
            f"The prompt has {len(prompt_ids)} tokens; with an item of {info.item_len} tokens it exceeds the "
            f"maximum context length of {ctx.max_model_len}.",
            param="prompt",
            code="context_length_exceeded",
        )
    params = SamplingParams(
        n=min(num_items, info.num_items),
        temperature=0.0,
        max_tokens=info.item_len,
        ignore_eos=True,
        use_beam_search=True,
        lora_name=lora_name,
        beam_width=body.beam_width,
        length_penalty=0.0,  # score = plain sum of logprobs (all items have the same length)
        beam_top_k=top_k,
        catalog=body.catalog,
    )
    req_id = new_request_id("rec")
    add = AddRequest(
        req_id=req_id,
        prompt_token_ids=prompt_ids,
        params=params,
        priority=body.priority,
        arrival_time=time.time(),
    )
    ticket = ctx.admit()
    try:
        deltas = await run_until_disconnected(request, _collect(ctx, add))
    except ClientDisconnected:
        raise InvalidRequestError("The client disconnected.") from None
    finally:
        ticket.release()
    items = [RecItem(item=list(d.new_token_ids), score=d.score) for d in deltas if d.score is not None]
    items.sort(key=lambda it: -it.score)
    num_out = sum(len(it.item) for it in items)
    usage = RecUsage(
        prompt_tokens=len(prompt_ids), completion_tokens=num_out, total_tokens=len(prompt_ids) + num_out
    )
    return RecGenerateResponse(
        id=req_id, model=lora_name or ctx.model_name, catalog=body.catalog, items=items, usage=usage
    )


async def _collect(ctx: ServingContext, add: AddRequest) -> list[CompletionDelta]:
    """Every sequence's final delta, by index; engine errors become API errors."""
    out: dict[int, CompletionDelta] = {}
    try:
        async for delta in ctx.engine_client.generate(add):
            if delta.error is not None:
                raise _engine_error(delta.error, add.params.catalog or "")
            if delta.finish_reason is not None:
                out[delta.index] = delta
    except EngineDeadError as exc:
        raise EngineUnavailableError(f"The engine stopped while serving this request: {exc}") from None
    return [out[i] for i in sorted(out)]


def _engine_error(message: str, catalog: str) -> Exception:
    if "no catalog named" in message:
        return not_found(catalog)
    if "invalid value for" in message:
        return from_value_error(ValueError(message))
    return InternalError(f"The engine failed this request: {message}")
