"""``POST /v1/chat/completions/batch`` (vLLM's): several conversations in one request, one choice each.

The body is a chat completions body whose ``messages`` is a list of conversations. Each conversation is
validated as its own ``/v1/chat/completions`` body (the same field rule, the same 400s, located under
``messages.<i>``) and all run concurrently; the answer is one ``chat.completion`` whose choice ``i``
answers conversation ``i`` and whose usage is the sum. As in vLLM: no streaming, no tools, no beam
search, ``n`` = 1, no ``prompt_logprobs`` (each refused with a 400 naming the field); with
``return_token_ids`` each choice carries its ``token_ids`` and ``prompt_token_ids`` is null (one prompt
per conversation), as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from xservice.http.errors import InvalidRequestError
from xservice.protocol import ChatCompletionRequest, ChatCompletionResponse, Usage, dump
from xservice.serving.chat import create_chat_completion
from xservice.serving.context import ServingContext, new_request_id

# field -> (values allowed in a batch, why others are refused)
_LIMITS: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": ((None, False), "streaming is not supported on the batch endpoint"),
    "tools": ((None, []), "tools are not supported on the batch endpoint"),
    "n": ((None, 1), "the batch endpoint returns one choice per conversation ('n' must be 1)"),
    "use_beam_search": ((None, False), "beam search is not supported on the batch endpoint"),
    "prompt_logprobs": ((None,), "prompt logprobs are not returned by the batch endpoint"),
}


def conversation_bodies(raw: dict[str, Any]) -> list[ChatCompletionRequest]:
    """One chat completions body per conversation of ``raw``; 400s name the field."""
    conversations = raw.get("messages")
    if not (
        isinstance(conversations, list)
        and conversations
        and all(isinstance(c, list) and c for c in conversations)
    ):
        _validate({**raw, "messages": [{"role": "user", "content": ""}]}, 0)  # the other fields' 400 first
        raise InvalidRequestError(
            "'messages' must be a non-empty list of conversations, each a non-empty list of messages.",
            param="messages",
        )
    for name, (allowed, why) in _LIMITS.items():
        if raw.get(name) not in allowed:
            raise InvalidRequestError(f"invalid value for '{name}': {why}", param=name)
    return [_validate({**raw, "messages": conversation}, i) for i, conversation in enumerate(conversations)]


def _validate(body: dict[str, Any], conversation: int) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([_located(e, conversation) for e in exc.errors()]) from None


def _located(error: Any, conversation: int) -> dict[str, Any]:
    """A sub-body's validation error, located in the batch body (``messages.<conversation>...``)."""
    loc = tuple(error.get("loc", ()))
    if loc[:1] == ("messages",):
        loc = ("messages", conversation, *loc[1:])
    return {**error, "loc": ("body", *loc)}


async def create_batch_chat_completion(
    ctx: ServingContext, raw: dict[str, Any], request: Request
) -> Response:
    """Run every conversation as a chat completion (concurrently) and merge the answers."""
    bodies = await ctx.bodies.run(
        len(await request.body()), conversation_bodies, raw
    )  # off the loop when large
    tasks = [asyncio.ensure_future(create_chat_completion(ctx, body, request)) for body in bodies]
    try:
        responses = await asyncio.gather(*tasks)
    except BaseException:  # one failed (or the client left): stop the others, report the first error
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    choices: list[dict[str, Any]] = []
    prompt = completion = cached = 0
    reasoning: int | None = None  # summed when the responses carry it (a reasoning parser is on)
    for i, resp in enumerate(responses):
        if resp.status_code != 200:  # e.g. the client disconnected
            return resp
        data = json.loads(resp.body)
        for choice in data["choices"]:
            choices.append({**choice, "index": i})
        usage = data["usage"]
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        details = usage.get("completion_tokens_details")
        if details is not None:
            reasoning = (reasoning or 0) + details.get("reasoning_tokens", 0)
    merged = ChatCompletionResponse.model_validate(
        {**data, "id": new_request_id("chatcmpl"), "choices": choices, "prompt_token_ids": None}
    )
    merged.usage = Usage.of(prompt, completion, cached, reasoning)
    return JSONResponse(dump(merged))
