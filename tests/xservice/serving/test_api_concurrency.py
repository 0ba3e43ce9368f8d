"""Many concurrent streams, and clients that go away mid-request (their engine requests must be aborted)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai

GUARD_S = 300.0  # keeps a broken build from hanging the suite; not a timing assertion
LONG = 230  # tokens a request would generate if nobody aborted it (prompt + LONG < max_model_len)


def test_64_concurrent_streams(server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await client.completions.create(
            model=server.model_name,
            prompt=f"Request number {i} says",
            max_tokens=8,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, finish, usage

    async def run_all() -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=GUARD_S
        )
        try:
            return list(await asyncio.gather(*(one(client, i) for i in range(64))))
        finally:
            await client.close()

    results = asyncio.run(asyncio.wait_for(run_all(), GUARD_S))
    assert len(results) == 64
    assert all(finish == "length" and usage == 8 for _, finish, usage in results), results


def _steps_and_free(http: httpx.Client, idle) -> tuple[int, int]:
    stats = idle(http)
    return stats["num_steps"], stats["num_free_blocks"]


def test_stream_disconnect_aborts_engine_request(server, http: httpx.Client, idle) -> None:
    steps0, free0 = _steps_and_free(http, idle)
    body = {
        "prompt": "A long story:",
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events += 1
                    if events == 3:
                        break  # leaving the block closes the connection mid-stream
    stats = idle(http, num_free_blocks=free0)
    assert stats["num_free_blocks"] == free0
    # Had the request not been aborted, the engine would have run LONG decode steps for it.
    assert stats["num_steps"] - steps0 < LONG // 2


def test_non_stream_disconnect_aborts_engine_request(server, http: httpx.Client, idle) -> None:
    steps0, free0 = _steps_and_free(http, idle)
    payload = json.dumps({"prompt": "Another long story:", "max_tokens": LONG, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(head + payload)
        deadline = time.monotonic() + GUARD_S
        while http.get("/v1/admin/stats").json()["num_running"] == 0:  # wait until the engine runs it
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        sock.close()
    stats = idle(http, num_free_blocks=free0)
    assert stats["num_steps"] - steps0 < LONG // 2
    assert stats["num_inflight"] == 0
