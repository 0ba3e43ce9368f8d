"""``build_app`` in-process over a real engine: per-app metrics registries and the last-resort 500.

(That ``/health`` is open and every other route needs the API key is checked against a real server in
``test_api_errors.py``: ``test_api_key_required``, ``test_api_key_accepted_and_health_open``.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from tests.xservice.conftest import ENGINE_SETTINGS, STARTUP_TIMEOUT_S
from xengine.api.text.tokenizer import Tokenizer
from xservice.config import XllmConfig, load_config
from xservice.engine.supervised import SupervisedEngine
from xservice.http.app import build_app


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[tuple[SupervisedEngine, XllmConfig]]:
    """A real engine process and its supervised client, on an event loop of its own thread (the apps
    below run on the test client's loop; the routes they call only read the client's state)."""
    overrides: dict[str, Any] = {k: dict(v) for k, v in ENGINE_SETTINGS.items()}
    overrides["model"]["model"] = str(model_dir)
    cfg = load_config(None, overrides)
    svc = cfg.service
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = SupervisedEngine.start(
        cfg.engine, svc.restart_policy(), svc.engine_startup_timeout_s, svc.engine_hang_timeout_s
    )
    client = asyncio.run_coroutine_threadsafe(start, loop).result(STARTUP_TIMEOUT_S)
    try:
        yield client, cfg
    finally:
        asyncio.run_coroutine_threadsafe(client.close(drain_timeout_s=2.0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _app(engine: tuple[SupervisedEngine, XllmConfig], tokenizer: Tokenizer | None):
    client, cfg = engine
    return build_app(client, tokenizer, cfg)


def test_each_app_owns_its_metrics_registry(engine, tokenizer) -> None:
    a, b = _app(engine, tokenizer), _app(engine, tokenizer)
    ra, rb = a.state.ctx.metrics.registry, b.state.ctx.metrics.registry
    assert ra is not rb and REGISTRY not in (ra, rb)
    a.state.ctx.metrics.record_error(400)
    assert ra.get_sample_value("xllm_request_errors_total", {"code": "400"}) == 1.0
    assert rb.get_sample_value("xllm_request_errors_total", {"code": "400"}) is None
    assert REGISTRY.get_sample_value("xllm_request_errors_total", {"code": "400"}) is None


def test_unexpected_failure_is_a_500_without_traceback(engine) -> None:
    with TestClient(_app(engine, None), raise_server_exceptions=False) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "xllm-tiny"  # the real engine's
        resp = client.post("/detokenize", json={"tokens": [5, 6]})  # no tokenizer: an internal bug
    assert resp.status_code == 500
    err = resp.json()["error"]
    assert err == {
        "message": "Internal server error.",
        "type": "internal_error",
        "param": None,
        "code": "internal_error",
    }
