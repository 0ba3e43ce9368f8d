"""Images on ``/v1/responses`` and the image path's ``/metrics``: ``xllm serve`` of a tiny Qwen2-VL
checkpoint driven by the ``openai`` client (``client.responses.create``) and httpx.

``input_image`` parts take chat's image path: greedy output, ``usage`` (image pads included) and the
400s (with the param naming the part of ``input``) match ``/v1/chat/completions`` for the same
conversation, streamed or not. ``/metrics`` counts encodes, encoded image tokens, encode steps and
image-cache hits.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.xengine.vl_oracle import data_url, random_image

openai = pytest.importorskip("openai")

MAX_TOKENS = 8
SMALL = random_image(56, 56, seed=1)  # 4 image tokens
WIDE = random_image(84, 112, seed=2)  # 12 image tokens
MEDIA_LIMITS = {"max_image_bytes": 100_000, "max_image_pixels": 20_000, "max_images_per_request": 3}


@pytest.fixture(scope="module")
def vl_server(launch_server, make_model_dir) -> Iterator[Any]:
    handle = launch_server(make_model_dir("qwen2_vl"), MEDIA_LIMITS)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def vl_http(vl_server) -> Iterator[httpx.Client]:
    with vl_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def client(vl_server) -> Any:
    return openai.OpenAI(base_url=vl_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto", **extra}


def _text(text: str) -> dict[str, Any]:
    return {"type": "input_text", "text": text}


def _as_chat(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses content parts as the same chat content parts."""
    return [
        {"type": "text", "text": p["text"]}
        if p["type"] == "input_text"
        else {"type": "image_url", "image_url": {"url": p["image_url"], "detail": p["detail"]}}
        for p in content
    ]


CASES: dict[str, tuple[str | None, list[dict[str, Any]]]] = {
    "1-image": (None, [_image(data_url(WIDE)), _text("What is in this picture?")]),
    "instructions, 2 images": (
        "You describe images.",
        [_text("Compare"), _image(data_url(SMALL)), _text("with"), _image(data_url(WIDE), detail="high")],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_images_match_chat(client, vl_server, name):
    instructions, content = CASES[name]
    messages = [{"role": "user", "content": _as_chat(content)}]
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    chat = client.chat.completions.create(
        model=vl_server.model_name,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
    )
    kw: dict[str, Any] = {"instructions": instructions} if instructions is not None else {}
    resp = client.responses.create(
        model=vl_server.model_name,
        input=[{"role": "user", "content": content}],
        temperature=0,
        max_output_tokens=MAX_TOKENS,
        **kw,
    )
    assert resp.status in ("completed", "incomplete")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens  # image pads count
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == resp.usage.output_tokens
    events = list(
        client.responses.create(
            model=vl_server.model_name,
            input=[{"role": "user", "content": content}],
            temperature=0,
            max_output_tokens=MAX_TOKENS,
            stream=True,
            **kw,
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text
    final = events[-1].response
    assert final.output_text == resp.output_text
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.usage.output_tokens == resp.usage.output_tokens


def _bad_cases() -> list[tuple[str, list[dict[str, Any]], str]]:
    """(what, content parts of input[1], the param the 400 names)."""
    at = "input.1.content.0"
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()
    good = data_url(SMALL)
    return [
        ("corrupt bytes", [_image(corrupt)], f"{at}.image_url"),
        ("not base64", [_image("data:image/png;base64,@@@not base64@@@")], f"{at}.image_url"),
        ("wrong media type", [_image("data:text/plain;base64,aGVsbG8=")], f"{at}.image_url"),
        ("network url", [_image("https://example.com/cat.png")], f"{at}.image_url"),
        ("too many images", [_image(good)] * 4, "input.1.content.3.image_url"),
        ("chat's object", [_image(good) | {"image_url": {"url": good}}], f"{at}.image_url"),
        ("no image_url", [{"type": "input_image", "detail": "auto"}], f"{at}.image_url"),
        ("file_id", [{"type": "input_image", "file_id": "file-abc", "detail": "auto"}], f"{at}.file_id"),
        ("file_id and url", [_image(good, file_id="file-abc")], f"{at}.file_id"),
        ("detail low", [_image(good, detail="low")], f"{at}.detail"),
        ("detail unknown", [_image(good, detail="ultra")], f"{at}.detail"),
        ("text on an image", [_image(good, text="hi")], f"{at}.text"),
        (
            "unknown part type",
            [_image(good), {"type": "input_file", "file_id": "f"}],
            "input.1.content.1.type",
        ),
    ]


def test_bad_image_parts_are_400s_naming_the_part(vl_http):
    body = {"instructions": "sys", "max_output_tokens": 2}
    for what, parts, param in _bad_cases():
        items = [{"role": "user", "content": "first"}, {"role": "user", "content": parts}]
        r = vl_http.post("/v1/responses", json={**body, "input": items})
        assert r.status_code == 400, (what, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (what, error)
    items = [{"role": "user", "content": [_image(data_url(WIDE)), _text("Hi")]}]
    r = vl_http.post("/v1/responses", json={**body, "input": items})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 12


def test_text_model_refuses_image_parts(http):
    items = [{"role": "user", "content": [_text("hi"), _image(data_url(SMALL))]}]
    r = http.post("/v1/responses", json={"input": items, "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input.0.content.1.type" and "takes no images" in error["message"]


def _counters(http: httpx.Client) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name.startswith("xllm_") and s.name.endswith("_total") and not s.labels:
                out[s.name] = s.value
    return out


def test_metrics_count_encodes_and_cache_hits(client, vl_server, vl_http):
    image = random_image(84, 112, seed=21)  # 12 image tokens, new to the server
    url = data_url(image)
    before = _counters(vl_http)
    for text in (
        "What is it?",
        "Another question first. Then: what is it?",
    ):  # the repeat: an image-cache hit
        content = [_text(text), _image(url)] if text.startswith("Another") else [_image(url), _text(text)]
        client.responses.create(
            model=vl_server.model_name,
            input=[{"role": "user", "content": content}],
            temperature=0,
            max_output_tokens=2,
        )
    after = _counters(vl_http)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["xllm_images_encoded_total"] == 1
    assert delta["xllm_image_tokens_encoded_total"] == 12
    assert delta["xllm_encode_steps_total"] == 1
    assert delta["xllm_image_cache_hits_total"] >= 1
    assert delta["xllm_prompt_images_total"] == 2
    assert delta["xllm_prompt_image_tokens_total"] == 24
