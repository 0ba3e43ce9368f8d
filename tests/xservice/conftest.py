"""Real HTTP servers for the API tests: a service process (uvicorn + ``build_app``) with its engine process.

``start_server`` launches ``python -c _LAUNCHER`` (a real ``SupervisedEngine`` + ``build_app`` under
uvicorn) on a free loopback port and waits for ``/health/ready``; ``ServerHandle.stop`` shuts it down
(SIGTERM, then SIGKILL) so no process outlives its fixture.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0  # guard against a broken build hanging the suite, not a timing assertion

# Engine settings shared by the servers and the offline ``LLM`` the outputs are compared with.
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    "model": {"max_model_len": 256, "seed": 0, "served_model_name": "xllm-tiny"},
    "cache": {"block_size": 16, "num_blocks": 320},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 512},
    "device": {"device": "cpu", "num_threads": 1},
}

_LAUNCHER = """
import asyncio, json, sys
import uvicorn
from xengine.api.text.tokenizer import Tokenizer
from xservice.http.app import build_app
from xservice.config import load_config
from xservice.engine.supervised import SupervisedEngine

async def main(overrides):
    cfg = load_config(None, overrides)
    svc = cfg.service
    client = await SupervisedEngine.start(
        cfg.engine, svc.restart_policy(), svc.engine_startup_timeout_s, svc.engine_hang_timeout_s
    )
    try:
        app = build_app(client, Tokenizer.from_dir(cfg.model.model), cfg)
        uv = uvicorn.Config(
            app,
            host=cfg.service.host,
            port=cfg.service.port,
            log_level="warning",
            timeout_keep_alive=cfg.service.keep_alive_s,
        )
        await uvicorn.Server(uv).serve()
    finally:
        await client.close(drain_timeout_s=2.0)

asyncio.run(main(json.loads(sys.argv[1])))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    """One running service (+ engine) process pair."""

    proc: subprocess.Popen
    port: int
    api_key: str | None
    log_path: Path
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    config_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        return self.config["model"]["served_model_name"]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log_path.unlink(missing_ok=True)
        if self.config_path is not None:
            self.config_path.unlink(missing_ok=True)


def _wait_ready(handle: ServerHandle) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(base_url=handle.base_url, timeout=5.0) as http:
        while time.monotonic() < deadline:
            if handle.proc.poll() is not None:
                raise RuntimeError(f"server exited with {handle.proc.returncode}:\n{handle.log_tail()}")
            try:
                if http.get("/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    handle.stop()
    raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s")


def start_server(
    model_dir: Path,
    service: dict[str, Any] | None = None,
    via_cli: bool = True,
    engine: dict[str, dict[str, Any]] | None = None,
) -> ServerHandle:
    """Start a service on a free port with ``ENGINE_SETTINGS`` (per section updated by ``engine``)
    and ``service`` overrides.

    ``via_cli``: run ``python -m xservice serve --config FILE`` (the product); otherwise a bare
    launcher around ``build_app`` that keeps serving (503s) after its engine died.
    """
    port = free_port()
    overrides = {
        k: {**ENGINE_SETTINGS.get(k, {}), **(engine or {}).get(k, {})}
        for k in {*ENGINE_SETTINGS, *(engine or {})}
    }
    overrides["model"]["model"] = str(model_dir)
    overrides["service"] = {"host": "127.0.0.1", "port": port, "log_level": "warning", **(service or {})}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    fd, log_name = tempfile.mkstemp(prefix="xllm-api-test-", suffix=".log")
    config_path = Path(log_name).with_suffix(".yaml")
    config_path.write_text(yaml.safe_dump(overrides))
    if via_cli:
        cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(config_path)]
    else:
        cmd = [sys.executable, "-c", _LAUNCHER, json.dumps(overrides)]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT)
        )
    handle = ServerHandle(proc, port, (service or {}).get("api_key"), Path(log_name), overrides, config_path)
    try:
        _wait_ready(handle)
    except BaseException:
        handle.stop()
        raise
    return handle


@pytest.fixture(scope="session")
def model_dir(make_model_dir: Callable[..., Path]) -> Path:
    return make_model_dir("qwen3", "tiny", 0)


# The shared server: most API tests run against it. max_body_bytes is small so 413 is cheap to test.
MAIN_SERVICE = {"max_body_bytes": 64 * 1024, "max_n": 16}


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(model_dir, MAIN_SERVICE)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from xengine.api.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def wait_idle(
    http: httpx.Client, num_free_blocks: int | None = None, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Poll ``/v1/admin/stats`` until nothing runs or waits (and ``num_free_blocks`` are free)."""
    deadline = time.monotonic() + timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stats = http.get("/v1/admin/stats").json()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and (num_free_blocks is None or stats["num_free_blocks"] == num_free_blocks):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"engine not idle after {timeout_s}s: {stats}")


@pytest.fixture(scope="session")
def launch_server() -> Callable[..., ServerHandle]:
    """``launch_server(model_dir, service_overrides, via_cli=True) -> ServerHandle``; the caller stops it."""
    return start_server


@pytest.fixture(scope="session")
def idle() -> Callable[..., dict[str, Any]]:
    """``idle(http, num_free_blocks=None)``: wait until the engine has nothing running or waiting."""
    return wait_idle


# Tool calling needs a template that renders tools the way real Qwen3 checkpoints do; the generated
# checkpoints carry plain ChatML, so this copy of the tiny one gets a Qwen3-style template.
TOOLS_TEMPLATE = Path(__file__).resolve().parent / "data" / "qwen3_tools.jinja"


@pytest.fixture(scope="session")
def tools_model_dir(make_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 checkpoint with a Qwen3-style tool-calling chat template (``chat_template.jinja``)."""
    import shutil

    out = tmp_path_factory.mktemp("tools-model") / "model"
    shutil.copytree(make_model_dir("qwen3", "tiny", 0), out)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE.read_text())
    return out


@pytest.fixture(scope="session")
def tools_server(tools_model_dir: Path) -> Iterator[ServerHandle]:
    """A server of ``tools_model_dir`` that trusts request chat templates (tools, responses, LangChain)."""
    service = {"trust_request_chat_template": True, "max_n": 4}
    # tool definitions take a few hundred tokens of the tiny tokenizer: a longer context than the default
    handle = start_server(tools_model_dir, service, engine={"model": {"max_model_len": 2048}})
    yield handle
    handle.stop()
