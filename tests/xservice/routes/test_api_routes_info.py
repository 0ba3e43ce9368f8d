"""``GET /v1/models/{model_id}`` and ``GET /version`` through the real server (``openai`` client, httpx)."""

from __future__ import annotations

from importlib import metadata

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_retrieve_model(client: openai.OpenAI, server) -> None:
    card = client.models.retrieve(server.model_name)
    assert card.id == server.model_name and card.object == "model"
    assert card == client.models.list().data[0].model_copy(update={"created": card.created})
    assert card.model_extra["max_model_len"] == server.config["model"]["max_model_len"]


def test_retrieve_unknown_model_is_404(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"
    # a name with a slash (as HF-style served names have) reaches the route too
    resp = http.get("/v1/models/org/no-such-model")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error == {
        "message": "The model 'org/no-such-model' does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_version(http: httpx.Client) -> None:
    resp = http.get("/version")
    assert resp.status_code == 200
    assert resp.json() == {"version": metadata.version("xllm")}
