"""``POST /tokenize`` and ``POST /detokenize`` with the served model's tokenizer and chat template."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from xservice.errors import InvalidRequestError
from xservice.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from xservice.serving.context import ServingContext, get_ctx
from xservice.serving.prompts import chat_prompt_ids, check_token_ids

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, ctx: ServingContext = Depends(get_ctx)) -> TokenizeResponse:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("Give exactly one of 'prompt' or 'messages'.", param="prompt")
    if body.messages is not None:
        ids = chat_prompt_ids(ctx.tokenizer, body.messages, body.add_generation_prompt)
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=ctx.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, ctx: ServingContext = Depends(get_ctx)) -> DetokenizeResponse:
    ctx.check_model(body.model)
    check_token_ids(body.tokens, ctx.vocab_size, "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens, skip_special_tokens=False))
