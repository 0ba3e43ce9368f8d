"""Multi-megabyte prompts: tokenized off the event loop, or refused by a character bound without tokenizing.

The server has a long context (131072 tokens), so a 4 MB prompt passes the character bound
(``max_model_len * max_token_chars``) and really is tokenized (about a second of CPU) before the
token count refuses it; meanwhile a running stream and ``/health`` must keep answering. Latencies
are compared with the time the same server takes for the big request, so a slow or busy machine
does not change the verdict: a loop blocked by tokenization stalls for that whole time.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

MAX_MODEL_LEN = 131072
MAX_BODY_BYTES = 64 * 1024 * 1024
GUARD_S = 300.0  # keeps a broken build from hanging the suite
WORDS = "the quick brown fox jumps over a lazy dog while serving engines stream tokens from cache".split()


def words_text(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(num_chars // 4 + 16))
    return text[:num_chars]


@pytest.fixture(scope="module")
def long_context_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model-long-context")
    for f in model_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def big_server(long_context_model: Path, launch_server) -> Iterator:
    handle = launch_server(
        long_context_model,
        {"max_body_bytes": MAX_BODY_BYTES},
        engine={"model": {"max_model_len": MAX_MODEL_LEN}, "cache": {"num_blocks": MAX_MODEL_LEN // 16}},
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def max_chars(tokenizer) -> int:
    """The character bound: longer texts are refused without tokenizing."""
    assert tokenizer.max_token_chars is not None
    return MAX_MODEL_LEN * tokenizer.max_token_chars


def post_json(client: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, float]:
    payload = json.dumps(body).encode()  # encoded before timing: only the server's time counts
    t0 = time.monotonic()
    resp = client.post(path, content=payload, headers={"Content-Type": "application/json"})
    return resp, time.monotonic() - t0


class Probes:
    """A long streamed completion and a /health poller, each on its own thread, timing what they get."""

    def __init__(self, server) -> None:
        self.server = server
        self.stop = threading.Event()
        self.token_times: list[float] = []
        self.health: list[tuple[float, float]] = []  # (start, latency)
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._guard, args=(f,)) for f in (self._stream, self._poll)]

    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # reported by the test, not lost in a thread
            self.errors.append(e)

    def _stream(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 20000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.server.base_url, timeout=GUARD_S) as client:
            with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.token_times.append(time.monotonic())
                    if self.stop.is_set():
                        return  # closing the stream aborts the engine request

    def _poll(self) -> None:
        with httpx.Client(base_url=self.server.base_url, timeout=GUARD_S) as client:
            while not self.stop.is_set():
                t0 = time.monotonic()
                assert client.get("/health").status_code == 200
                self.health.append((t0, time.monotonic() - t0))
                time.sleep(0.02)

    def __enter__(self) -> Probes:
        for t in self._threads:
            t.start()
        deadline = time.monotonic() + GUARD_S
        while len(self.token_times) < 10:  # the stream is decoding
            assert time.monotonic() < deadline and not self.errors, self.errors
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(GUARD_S)
        assert not self.errors, self.errors

    def max_token_gap(self, start: float, end: float) -> float:
        times = [t for t in self.token_times if start <= t <= end]
        assert len(times) >= 10, "the stream made no progress during the window"
        return max(b - a for a, b in zip(times, times[1:]))

    def max_health_latency(self, start: float, end: float) -> float:
        latencies = [lat for t0, lat in self.health if start <= t0 <= end]
        assert latencies, "no /health call during the window"
        return max(latencies)


def test_huge_prompts_do_not_stall_streams_or_health(big_server, max_chars: int) -> None:
    under = words_text(min(4_000_000, max_chars - 1000))  # passes the bound: tokenized for real
    over = words_text(max_chars + 1)
    with big_server.client(timeout=GUARD_S) as http, Probes(big_server) as probes:
        start = time.monotonic()
        cmpl, cmpl_s = post_json(http, "/v1/completions", {"prompt": under})
        tok, tok_s = post_json(http, "/tokenize", {"prompt": under})
        chat_body = {"messages": [{"role": "user", "content": under}]}
        chat, chat_s = post_json(http, "/v1/chat/completions", chat_body)
        refused, _ = post_json(http, "/v1/completions", {"prompt": over, "max_tokens": 1})
        end = time.monotonic()
        gap, health = probes.max_token_gap(start, end), probes.max_health_latency(start, end)

    # Each big request tokenized 4 MB: a loop that did it inline would stall for that whole time (most
    # of the request's), so the stalls are compared with the fastest big request of this same run.
    tokenize_s = min(cmpl_s, tok_s, chat_s)
    timings = f"gap {gap:.3f}s, /health {health:.3f}s, big requests {cmpl_s:.2f}/{tok_s:.2f}/{chat_s:.2f}s"
    assert gap < tokenize_s / 2, timings
    assert health < tokenize_s / 2, timings

    # Under the bound: tokenized, then refused by the token count (which the message gives).
    assert cmpl.status_code == 400, cmpl.text
    err = cmpl.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert "in the prompt" in err["message"]
    assert chat.status_code == 400 and "in the messages" in chat.json()["error"]["message"], chat.text
    assert tok.status_code == 200
    body = tok.json()
    assert body["count"] == len(body["tokens"]) > MAX_MODEL_LEN
    # Over the bound: refused from its length alone.
    assert refused.status_code == 400
    # the length-bound message (characters), not the token-count one: it was never tokenized
    assert f"{len(over)} characters" in refused.json()["error"]["message"]
    assert "in the prompt" not in refused.json()["error"]["message"]


def test_over_the_bound_is_refused_without_tokenizing(big_server, max_chars: int) -> None:
    huge = words_text(20_000_000)  # ~5x the bound; tokenizing it would take seconds
    cases = [
        ("/v1/completions", {"prompt": huge, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["short prompt", huge], "max_tokens": 1}, "prompt"),
        ("/tokenize", {"prompt": huge}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": huge}]}, "messages"),
    ]
    with big_server.client(timeout=GUARD_S) as http:
        for path, body, param in cases:
            resp, _ = post_json(http, path, body)
            assert resp.status_code == 400, (path, resp.text[:300])
            err = resp.json()["error"]
            assert err["param"] == param and err["code"] == "context_length_exceeded", err
            assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
            assert f"({max_chars} characters" in err["message"], err["message"]
            # Refused from its length (the chat template is rendered, cheap); the tokenizer never ran:
            # a tokenized prompt is refused with its token count "in the prompt" / "in the messages".
            assert "in the prompt" not in err["message"] and "in the messages" not in err["message"]


def test_huge_detokenize(big_server, tokenizer) -> None:
    ids = tokenizer.encode(words_text(1_000_000))
    with big_server.client(timeout=GUARD_S) as http:
        resp, _ = post_json(http, "/detokenize", {"tokens": ids})
    assert resp.status_code == 200
    assert resp.json()["prompt"] == tokenizer.decode(ids, skip_special_tokens=False)
