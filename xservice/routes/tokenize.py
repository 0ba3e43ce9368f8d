"""``POST /tokenize`` and ``POST /detokenize`` with the served model's tokenizer and chat template.

Large inputs are tokenized, decoded and rendered to JSON on the tokenizer workers, off the loop.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel

from xservice.errors import InvalidRequestError
from xservice.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.prompts import chat_prompt_ids, check_text_chars, check_token_ids

router = APIRouter()


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _tokenize_response(ids: list[int], max_model_len: int) -> Response:
    return _json(TokenizeResponse.model_construct(tokens=ids, count=len(ids), max_model_len=max_model_len))


def _detokenize_response(ctx: ServingContext, ids: list[int]) -> Response:
    check_token_ids(ids, ctx.vocab_size, "tokens")
    return _json(DetokenizeResponse(prompt=ctx.tokenizer.decode(ids, skip_special_tokens=False)))


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, ctx: ServingContext = Depends(get_ctx)) -> Response:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("Give exactly one of 'prompt' or 'messages'.", param="prompt")
    if body.messages is not None:
        ids = await chat_prompt_ids(ctx, body.messages, body.add_generation_prompt)
    else:
        check_text_chars(len(body.prompt), ctx.max_model_len, ctx.text.max_token_chars, "prompt")
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await ctx.text.encode(body.prompt, add_special_tokens=add_special)
    return await ctx.text.run(len(ids), _tokenize_response, ids, ctx.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, ctx: ServingContext = Depends(get_ctx)) -> Response:
    ctx.check_model(body.model)
    return await ctx.text.run(len(body.tokens), _detokenize_response, ctx, body.tokens)
