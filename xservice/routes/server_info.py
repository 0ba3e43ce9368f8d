"""``GET /load`` and ``GET /tokenizer_info``: vLLM's server-information routes, each behind the option
vLLM has for it (``service.enable_server_load_tracking``, ``service.enable_tokenizer_info_endpoint``);
off, they are a 404 naming the option."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from xservice.http.errors import NotFoundError
from xservice.routes.error_responses import errors
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()

_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")  # paths on the server: not shown


@router.get("/load", responses=errors(404))
async def server_load(ctx: ServingContext = Depends(get_ctx)) -> dict[str, int]:
    """Generation requests in flight (chat, completions, responses, embeddings): admitted, not finished."""
    if not ctx.config.service.enable_server_load_tracking:
        raise NotFoundError("GET /load is off; start the server with --enable-server-load-tracking.")
    return {"server_load": ctx.num_inflight}


@router.get("/tokenizer_info", responses=errors(404))
async def tokenizer_info(ctx: ServingContext = Depends(get_ctx)) -> dict[str, Any]:
    """The tokenizer's configuration (``tokenizer_config.json`` without file paths), its class and the
    chat template the server renders with."""
    if not ctx.config.service.enable_tokenizer_info_endpoint:
        raise NotFoundError(
            "GET /tokenizer_info is off; start the server with --enable-tokenizer-info-endpoint."
        )
    tokenizer = ctx.tokenizer
    info = {k: v for k, v in tokenizer.config.items() if k not in _FILE_FIELDS}
    info["tokenizer_class"] = str(tokenizer.config.get("tokenizer_class") or "PreTrainedTokenizerFast")
    info.pop("chat_template", None)
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info
