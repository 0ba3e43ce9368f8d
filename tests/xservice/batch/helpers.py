"""Shared by the batch tests (and the other tests that run batches): a service with a ``batch``
section, job lines, submitting through the ``openai`` client and waiting for a job; killing a
service's whole process tree.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

GUARD_S = 120.0  # guards against a hang, not a timing assertion
FINAL = ("completed", "failed", "expired", "cancelled")


WAIT_TIMEOUT_S = 240.0  # guards against a hang, not a timing assertion


def start_batch_server(
    launch_server: Callable[..., Any],
    model_dir: Path,
    data_dir: Path,
    batch: dict[str, Any] | None = None,
    scheduler: dict[str, Any] | None = None,
) -> Any:
    """``launch_server`` with a ``batch`` section (and scheduler overrides) in its config file."""
    settings = launch_server.__globals__["ENGINE_SETTINGS"]  # the config the launcher writes
    saved = dict(settings)
    settings["batch"] = {"data_dir": str(data_dir), **(batch or {})}
    settings["scheduler"] = {**settings["scheduler"], **(scheduler or {})}
    try:
        return launch_server(model_dir, {})
    finally:
        settings.clear()
        settings.update(saved)


def openai_client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_line(custom_id: str, content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0.0}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**body, **extra},
    }


def completion_line(custom_id: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def submit(client: openai.OpenAI, path: Path, endpoint: str) -> Any:
    with open(path, "rb") as f:
        file = client.files.create(file=f, purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def wait_batch(client: openai.OpenAI, batch_id: str, until: Callable[[Any], bool] | None = None) -> Any:
    """Poll until ``until(batch)`` (default: a final status)."""
    until = until or (lambda b: b.status in FINAL)
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} not there after {WAIT_TIMEOUT_S}s: {batch}")


def read_file(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def wait_for(what: str, check: Callable[[], Any], guard_s: float = GUARD_S) -> Any:
    """Poll ``check()`` until it returns something truthy; fail after ``guard_s``."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not reached after {guard_s}s: {what}")


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children.get(pid, [])
    return out


def kill_tree(server: Any) -> None:
    """SIGKILL the service and everything it started (engine, workers): nothing gets to clean up."""
    for pid in process_tree(server.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait(timeout=60)
