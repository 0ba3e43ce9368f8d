"""``POST /tokenize`` and ``POST /detokenize`` with the served model's tokenizer and chat template.

Large inputs are tokenized, decoded and rendered to JSON on the tokenizer workers, off the loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel

from xservice.http.errors import InvalidRequestError
from xservice.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from xservice.protocol.tools import FunctionDefinition
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import errors
from xservice.serving.chat_render import ChatRender, chat_render_of
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.prompts import chat_prompt_ids, check_text_chars, check_token_ids
from xservice.serving.text_workers import INLINE_MAX_COST
from xservice.serving.tools.plan import chat_param, check_functions, rendered_tools

router = APIRouter(route_class=BodyRoute)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _tokenize_response(ctx: ServingContext, ids: list[int], token_strs: bool) -> Response:
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if token_strs else None
    return _json(
        TokenizeResponse.model_construct(
            tokens=ids, count=len(ids), max_model_len=ctx.max_model_len, token_strs=strs
        )
    )


def _detokenize_response(ctx: ServingContext, ids: list[int]) -> Response:
    check_token_ids(ids, ctx.vocab_size, "tokens")
    return _json(DetokenizeResponse(prompt=ctx.tokenizer.decode(ids, skip_special_tokens=False)))


_CHAT_ONLY = ("tools", "chat_template", "chat_template_kwargs", "documents", "continue_final_message")


def _check_no_chat_fields(body: TokenizeRequest) -> None:
    """400 for chat template inputs sent with a plain ``prompt`` (they would do nothing)."""
    for name in _CHAT_ONLY:
        if getattr(body, name) not in (None, False):
            raise InvalidRequestError(f"'{name}' applies to 'messages', not to 'prompt'.", param=name)


async def tokenize_render(ctx: ServingContext, body: TokenizeRequest) -> ChatRender:
    """The template options of a chat /tokenize request (tools rendered as a chat request would)."""
    render = await chat_render_of(ctx, body)
    if not body.tools:
        return render
    functions = [tool.function for tool in body.tools]
    # on a worker: the tools' schemas are checked and copied (their size is not known before)
    tools = await ctx.text.run(INLINE_MAX_COST + 1, _checked_tools, functions)
    if "tools" not in render.template_vars:
        raise InvalidRequestError("This model's chat template does not render tools.", param="tools")
    return render.with_tools(tools)


def _checked_tools(functions: list[FunctionDefinition]) -> list[dict[str, Any]]:
    check_functions(functions, chat_param)
    return rendered_tools(functions)


@router.post("/tokenize", response_model=TokenizeResponse, responses=errors(404))
async def tokenize(body: TokenizeRequest, ctx: ServingContext = Depends(get_ctx)) -> Response:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("Give exactly one of 'prompt' or 'messages'.", param="prompt")
    if body.messages is None:
        _check_no_chat_fields(body)
    if body.messages is not None:
        render = await tokenize_render(ctx, body)
        ids = await chat_prompt_ids(ctx, body.messages, body.add_generation_prompt, render=render)
    else:
        check_text_chars(len(body.prompt), ctx.max_model_len, ctx.text.max_token_chars, "prompt")
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await ctx.text.encode(body.prompt, add_special_tokens=add_special)
    return await ctx.text.run(len(ids), _tokenize_response, ctx, ids, body.return_token_strs)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=errors(404))
async def detokenize(body: DetokenizeRequest, ctx: ServingContext = Depends(get_ctx)) -> Response:
    ctx.check_model(body.model)
    return await ctx.text.run(len(body.tokens), _detokenize_response, ctx, body.tokens)
