"""The embedded default model, served the way ``ci/serve.sh`` serves it: ``xllm serve`` without
``--model`` builds ``default-qwen3-small`` (qwen3, size small, seed 0) into the cache folder on first
use and serves it; one greedy completion is HF ``transformers``' on the same weights.

The cache folder is the test's own (``XLLM_CACHE_DIR``), so the first-use build runs here too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.xservice.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600.0  # the first use builds the model: guards a broken build, not a timing assertion
PROMPT = "Once upon a time"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``xllm serve --port P`` with an empty cache folder; yields (base URL, the built model folder)."""
    cache = tmp_path_factory.mktemp("xllm-cache")
    port = free_port()
    env = dict(os.environ, XLLM_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = cache / "serve.log"
    cmd = [sys.executable, "-m", "xservice", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--num-threads", "1"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=str(ROOT), start_new_session=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the default model was not served"
            try:
                if httpx.get(f"{base_url}/health/ready", timeout=5.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base_url, cache / "models" / "default-qwen3-small"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the watchdog and the server under it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_the_default_model_answers_like_hf_transformers(default_server: tuple[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from xengine.api.text.tokenizer import Tokenizer

    base_url, model_dir = default_server
    with httpx.Client(base_url=base_url, timeout=120.0) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["default-qwen3-small"]
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length" and resp.json()["usage"]["completion_tokens"] == MAX_TOKENS

    tokenizer = Tokenizer.from_dir(model_dir)
    prompt_ids = tokenizer.encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.num_parameters() > 50_000_000  # the small size, not a tiny test checkpoint
    hf.generation_config.eos_token_id = None  # as ignore_eos
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS)
    expected = out[0, len(prompt_ids) :].tolist()
    assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
