"""``/v1/embeddings``: inputs (text or token ids, one or many) → one prefill-only engine request each →
the pooled, normalised final hidden state of each input's last token.

Each input is its own engine request (``max_tokens=0`` with ``PoolingParams``), so inputs batch with
whatever else runs and keep their prefix-cache hits (last-token pooling needs only the last position).
"""

from __future__ import annotations

import base64
import sys
import time
from array import array
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xengine.api.messages import PoolingParams, SamplingParams
from xservice.http.errors import InvalidRequestError
from xservice.protocol import dump
from xservice.protocol.embeddings import (
    Embedding,
    EmbeddingInput,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from xservice.serving.context import ServingContext, new_request_id
from xservice.serving.generation import Generation, collect_all
from xservice.serving.prompts import check_text_chars, check_token_ids
from xservice.serving.streaming import ClientDisconnected, disconnected_response, run_until_disconnected

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request


async def create_embeddings(ctx: ServingContext, body: EmbeddingRequest, request: Request) -> Response:
    """Validate, admit and run an embeddings request."""
    arrival = time.monotonic()
    lora_name = ctx.check_model(body.model)
    _check_dimensions(body.dimensions, ctx.engine_client.info.hidden_size)
    inputs = await _input_ids(ctx, body.input)
    req_id = new_request_id("embd")
    params = SamplingParams(max_tokens=0, lora_name=lora_name)
    pooling = PoolingParams(dimensions=body.dimensions)
    gens = [
        Generation(ctx, f"{req_id}-{i}", ids, params, body.priority, arrival=arrival, pooling=pooling)
        for i, ids in enumerate(inputs)
    ]
    ticket = ctx.admit()
    try:
        await run_until_disconnected(request, collect_all(gens))
    except ClientDisconnected:
        return disconnected_response()
    finally:
        ticket.release()
    data = [
        Embedding(index=i, embedding=_encode(_vector(g), body.encoding_format)) for i, g in enumerate(gens)
    ]
    num_tokens = sum(len(ids) for ids in inputs)
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return JSONResponse(
        dump(EmbeddingResponse(id=req_id, model=lora_name or ctx.model_name, data=data, usage=usage))
    )


def _check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """400 unless ``dimensions`` is unset or in [1, hidden size] (0: the engine did not say; it checks)."""
    if dimensions is None or (dimensions >= 1 and (not hidden_size or dimensions <= hidden_size)):
        return
    bound = f"[1, {hidden_size}] (the model's hidden size)" if hidden_size else "a positive integer"
    raise InvalidRequestError(
        f"invalid value for 'dimensions': must be in {bound}, got {dimensions}", param="dimensions"
    )


def _vector(gen: Generation) -> list[float]:
    embedding = gen.state.embedding
    if embedding is None:  # a finished pooling request always carries it
        raise RuntimeError(f"request {gen.req_id} finished without an embedding")
    return embedding


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the numbers; ``base64``: their little-endian float32 bytes, base64 (as OpenAI)."""
    if encoding_format == "float":
        return vector
    packed = array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


async def _input_ids(ctx: ServingContext, given: EmbeddingInput) -> list[list[int]]:
    """Token ids of each input; 400 naming ``input`` when empty, too many, out of vocabulary or too long
    (every cheap check runs before any text is tokenized)."""
    items: list[Any] = (
        [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
    )
    if not items:
        raise InvalidRequestError("'input' must not be empty.", param="input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(
            f"At most {MAX_INPUTS} inputs per request, got {len(items)}.", param="input"
        )
    for item in items:
        if not item:
            raise InvalidRequestError(
                "'input' must not contain an empty string or token list.", param="input"
            )
        if isinstance(item, str):
            check_text_chars(len(item), ctx.max_model_len, ctx.text.max_token_chars, "input")
        else:
            check_token_ids(item, ctx.vocab_size, "input")
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(await ctx.text.run(sum(map(len, texts)), _encode_texts, ctx.tokenizer, texts))
    out = [next(encoded) if isinstance(item, str) else list(item) for item in items]
    for ids in out:
        if not ids:
            raise InvalidRequestError(
                "'input' must not contain an empty string or token list.", param="input"
            )
        if len(ids) > ctx.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, an input has "
                f"{len(ids)} tokens. Please reduce the length of the input.",
                param="input",
                code="context_length_exceeded",
            )
    return out


def _encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=True) for text in texts]
