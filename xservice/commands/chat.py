"""``xllm chat``: a terminal chat against a running xllm (or any OpenAI-compatible) server."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from xservice.commands.common import CliError


def register_chat(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat with a running server in the terminal",
        description="Terminal chat against a running xllm (or any OpenAI-compatible) server. "
        "Type /reset to clear the history, /exit or Ctrl-D to quit.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="server base URL (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="API key, if the server requires one")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default: %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature (default: %(default)s)"
    )
    p.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/") + "/"
    with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(600.0, connect=5.0)) as http:
        try:
            model = args.model or _first_model(http)
        except httpx.HTTPError as e:
            raise CliError(
                f"cannot reach {args.url} ({e}); start a server with 'xllm serve' or pass --url"
            ) from e
        history = [{"role": "system", "content": args.system}] if args.system else []
        print(f"chatting with {model} at {args.url} (/reset clears the history, /exit quits)")
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                history = history[:1] if args.system else []
                continue
            if line:
                history.append({"role": "user", "content": line})
                reply = _stream_reply(http, model, history, args)
                if reply is None:
                    history.pop()  # the turn failed: forget it
                else:
                    history.append({"role": "assistant", "content": reply})


def _first_model(http: Any) -> str:
    resp = http.get("models")
    if resp.status_code != 200:
        raise CliError(f"GET {resp.url} answered {resp.status_code}: {_error_message(resp.text)}")
    data = resp.json().get("data") or []
    if not data:
        raise CliError("the server lists no models; pass --model")
    return data[0]["id"]


def _stream_reply(http: Any, model: str, history: list[dict], args: argparse.Namespace) -> str | None:
    """Stream one reply to stdout; returns its text, or None when the server refused."""
    body = {
        "model": model,
        "messages": history,
        "stream": True,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    parts: list[str] = []
    print("assistant> ", end="", flush=True)
    with http.stream("POST", "chat/completions", json=body) as resp:
        if resp.status_code != 200:
            print(f"[error {resp.status_code}: {_error_message(resp.read().decode())}]")
            return None
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            _print_chunk(json.loads(payload), parts.append)
    print()
    return "".join(parts)


def _print_chunk(chunk: dict, keep: Callable[[str], None]) -> None:
    if "error" in chunk:
        print(f"[error: {_error_message(json.dumps(chunk))}]", end="")
        return
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            print(text, end="", flush=True)
            keep(text)


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]
