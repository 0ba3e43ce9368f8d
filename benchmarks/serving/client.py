"""One streaming OpenAI request (completions or chat) timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.serving.metrics import RequestRecord


@dataclass(frozen=True)
class RequestSpec:
    """What to send: the endpoint kind, model name, prompt and output settings."""

    base_url: str
    endpoint: str  # "completions" | "chat"
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    ignore_eos: bool = True
    api_key: str | None = None
    image_urls: tuple[str, ...] = ()  # chat only: image_url parts (data: URLs) before the text
    extra: dict | None = None  # more body fields (e.g. xllm's per-request ``slo``)


def build_payload(spec: RequestSpec) -> dict:
    """The JSON body: streaming with usage, greedy, ``ignore_eos`` as an extra field."""
    body: dict = {
        "model": spec.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.endpoint == "chat" and spec.image_urls:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in spec.image_urls]
        body["messages"] = [{"role": "user", "content": [*parts, {"type": "text", "text": spec.prompt}]}]
    elif spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return {**body, **(spec.extra or {})}


def is_output_chunk(chunk: dict) -> bool:
    """Whether a stream chunk carries generated output.

    Like vLLM's benchmark, every chunk with a choice counts, even one whose text is empty because
    the detokenizer holds back an incomplete character. Unlike it, a chat chunk that only announces
    the assistant role is skipped: some servers send it before the first token (OpenAI does).
    """
    choices = chunk.get("choices")
    if not choices:
        return False
    delta = choices[0].get("delta")
    return not (delta is not None and "role" in delta and not delta.get("content"))


async def _iter_sse_data(resp: aiohttp.ClientResponse):
    """Yield the payload of each ``data:`` line of a server-sent-events stream."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


async def send_request(session: aiohttp.ClientSession, spec: RequestSpec) -> RequestRecord:
    """Send one streaming request and time it; never raises (errors land in the record)."""
    path = "chat/completions" if spec.endpoint == "chat" else "completions"
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    rec = RequestRecord(prompt_len=spec.prompt_len)
    num_chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        async with session.post(f"{spec.base_url}/{path}", json=build_payload(spec), headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for data in _iter_sse_data(resp):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if usage := chunk.get("usage"):
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    rec.prompt_len = usage.get("prompt_tokens") or rec.prompt_len
                if not is_output_chunk(chunk):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.append(now - last)
                last = now
                num_chunks += 1
        rec.e2e_s = time.perf_counter() - start
        rec.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        rec.success = num_chunks > 0 or rec.output_tokens > 0
        if not rec.success:
            rec.error = "empty response"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec
