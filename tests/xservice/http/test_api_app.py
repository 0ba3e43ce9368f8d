"""``build_app`` in-process (no engine needed): per-app metrics registries, auth, the last-resort 500."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from xservice.config import ServiceConfig, XllmConfig
from xservice.http.app import build_app


class _ServingStandIn:
    """Stands in for the engine client's health view only; no route these tests call generates."""

    is_alive = True
    health = "ok"
    info = SimpleNamespace(model_name="stand-in")  # labels the vLLM-named metrics

    def restart_counts(self) -> dict[str, int]:
        return {}

    def given_up(self) -> list[str]:
        return []


def _app(**service):
    # No engine behind these apps: only routes that never reach it are called (and one that does, for 500).
    return build_app(_ServingStandIn(), None, XllmConfig(service=ServiceConfig(**service)))


def test_each_app_owns_its_metrics_registry() -> None:
    a, b = _app(), _app()
    ra, rb = a.state.ctx.metrics.registry, b.state.ctx.metrics.registry
    assert ra is not rb and REGISTRY not in (ra, rb)
    a.state.ctx.metrics.record_error(400)
    assert ra.get_sample_value("xllm_request_errors_total", {"code": "400"}) == 1.0
    assert rb.get_sample_value("xllm_request_errors_total", {"code": "400"}) is None
    assert REGISTRY.get_sample_value("xllm_request_errors_total", {"code": "400"}) is None


def test_health_is_open_and_other_routes_need_the_key() -> None:
    with TestClient(_app(api_key="secret")) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health/live").json() == {"status": "ok"}
        resp = client.get("/v1/models")
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_unexpected_failure_is_a_500_without_traceback() -> None:
    with TestClient(_app(), raise_server_exceptions=False) as client:
        resp = client.get("/v1/models")  # no engine client: an internal bug, not the caller's fault
    assert resp.status_code == 500
    err = resp.json()["error"]
    assert err == {
        "message": "Internal server error.",
        "type": "internal_error",
        "param": None,
        "code": "internal_error",
    }
