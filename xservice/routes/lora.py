"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters added and dropped
while serving, as vLLM's (behind ``lora.allow_runtime_lora_updating``, vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; off, both are a 404 naming the option). Every engine of the
server registers the adapter before it is listed or served; the answers are vLLM's plain texts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from xservice.http.errors import InvalidRequestError, NotFoundError
from xservice.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from xservice.routes.error_responses import errors
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter()
_TEXT = {
    200: {
        "description": "vLLM's plain-text success message",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}
_LOCK = asyncio.Lock()  # one change at a time: every engine sees the same order


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):  # a NUL byte, a name too long: no such folder
        return False


def _check_enabled(ctx: ServingContext, route: str) -> None:
    if not ctx.config.lora.allow_runtime_lora_updating:
        raise NotFoundError(f"POST {route} is off; start the server with --allow-runtime-lora-updating.")


@router.post("/v1/load_lora_adapter", response_model=None, responses={**errors(400, 404), **_TEXT})
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, ctx: ServingContext = Depends(get_ctx)
) -> PlainTextResponse:
    _check_enabled(ctx, "/v1/load_lora_adapter")
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    if body.is_3d_lora_weight:
        raise InvalidRequestError(
            "3D (MoE expert) LoRA weights are not supported.", param="is_3d_lora_weight"
        )
    if not ctx.loras.enabled:
        raise InvalidRequestError(
            "This server serves no LoRA adapters; start it with --enable-lora.", param="lora_name"
        )
    if name == ctx.model_name:
        raise InvalidRequestError(
            f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name"
        )
    async with _LOCK:
        if name in ctx.loras.adapters and not body.load_inplace:
            raise InvalidRequestError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                param="lora_name",
            )
        if not _is_dir(path):
            raise NotFoundError(f"Loading lora {name} failed: No adapter found for {path}", param="lora_path")
        ctx.check_engine()
        try:
            await ctx.engine_client.load_lora(name, path, replace=body.load_inplace)
        except ValueError as e:
            raise InvalidRequestError(f"Loading lora {name} failed: {e}", param="lora_path") from None
        ctx.loras.adapters[name] = path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_model=None, responses={**errors(400, 404), **_TEXT})
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, ctx: ServingContext = Depends(get_ctx)
) -> PlainTextResponse:
    _check_enabled(ctx, "/v1/unload_lora_adapter")
    name = body.lora_name
    if not name:
        raise InvalidRequestError(
            "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name"
        )
    async with _LOCK:
        if name not in ctx.loras.adapters:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        ctx.check_engine()
        del ctx.loras.adapters[name]  # new requests naming it are refused from now on
        try:
            await ctx.engine_client.unload_lora(name)
        except KeyError:
            pass  # an engine that never had it (restarted without it): nothing to drop
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
