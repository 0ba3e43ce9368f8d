"""``xllm serve`` with a ``max_model_len`` past the checkpoint's positions: refused at start-up with the
fix on stderr (before, it started and the first request past ``max_position_embeddings`` killed the
engine); with a checkpoint whose rope scaling allows it, the server answers such requests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.xservice.conftest import ENGINE_SETTINGS, ROOT, free_port, start_server

MAX_POSITION = 4096  # of the tiny checkpoints
LONG = 2 * MAX_POSITION
LONG_SETTINGS = {"model": {"max_model_len": LONG}, "cache": {"num_blocks": LONG // 16 + 8}}
GUARD_S = 300.0  # bounds a hanging start-up; not a timing assertion


def test_serve_refuses_max_model_len_past_max_position_embeddings(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    config = {k: {**v, **LONG_SETTINGS.get(k, {})} for k, v in ENGINE_SETTINGS.items()}
    config["model"]["model"] = str(model_dir)
    config["service"] = {"host": "127.0.0.1", "port": port, "log_level": "warning"}
    path = tmp_path / "xllm.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(path)]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        assert not became_ready(proc, port), (
            "the server started with max_model_len past max_position_embeddings"
        )
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode != 0
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("xllm: error: the engine did not start"), stderr[-3000:]
    assert f"max_model_len {LONG} is longer than the {MAX_POSITION} positions this model supports" in last
    assert f"lower --max-model-len (model.max_model_len) to {MAX_POSITION} or less" in last


def became_ready(proc: subprocess.Popen, port: int) -> bool:
    """Wait until ``proc`` exits (False) or answers ``/health/ready`` (True)."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the server neither started nor exited in {GUARD_S}s")


def test_serve_with_rope_scaling_answers_past_max_position_embeddings(make_config_variant) -> None:
    rope = {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    model_dir = make_config_variant("rope-linear", {"rope_parameters": rope})
    server = start_server(model_dir, engine=LONG_SETTINGS)
    try:
        with server.client() as http:
            assert http.get("/v1/models").json()["data"][0]["max_model_len"] == LONG
            for length in (MAX_POSITION + 4, 12):  # past the original positions, then a short one
                prompt = [3 + (i * 7) % 2000 for i in range(length)]
                body = {"model": server.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
                body["ignore_eos"] = True
                resp = http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                usage = resp.json()["usage"]
                assert (usage["prompt_tokens"], usage["completion_tokens"]) == (length, 4)
    finally:
        server.stop()
