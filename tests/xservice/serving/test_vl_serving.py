"""Images over the OpenAI API: ``xllm serve`` of a tiny Qwen2-VL checkpoint, driven by the ``openai``
client and httpx, against HF ``transformers`` on the same weights (``tests/xengine/vl_oracle.py``).

Greedy tokens and ``usage.prompt_tokens`` (image pads included) match HF with 0, 1 and 2 images,
streamed or not; a repeated image hits the image-embedding cache and the prefix cache (visible in
``/v1/admin/stats`` and ``usage``); every bad image is a 400 naming its part, and the server keeps
serving; text prompts still work through the VL model.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.xengine.vl_oracle import VLOracle, data_url, random_image, user_turn

openai = pytest.importorskip("openai")

MAX_TOKENS = 8
SMALL = random_image(56, 56, seed=1)  # 4 image tokens
WIDE = random_image(84, 112, seed=2)  # 12 image tokens
MEDIA_LIMITS = {"max_image_bytes": 100_000, "max_image_pixels": 20_000, "max_images_per_request": 3}
GREEDY: dict[str, Any] = {
    "temperature": 0,
    "max_tokens": MAX_TOKENS,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[Any]]] = {
    "0-images": ([{"role": "user", "content": "Tell me about the weather in the mountains."}], []),
    "1-image": ([user_turn(WIDE, "What is in this picture?")], [WIDE]),
    "2-images": (
        [{"role": "system", "content": "You describe images."}, user_turn("Compare", SMALL, "with", WIDE)],
        [SMALL, WIDE],
    ),
}


@pytest.fixture(scope="module")
def vl_dir(make_model_dir) -> Path:
    return make_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def oracle(vl_dir: Path) -> VLOracle:
    return VLOracle(vl_dir)


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allow-listed folder, holding SMALL as a PNG (and a file beside it, outside the list)."""
    root = tmp_path_factory.mktemp("vl-media")
    (root / "allowed").mkdir()
    SMALL.save(root / "allowed" / "small.png")
    SMALL.save(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def vl_server(launch_server, vl_dir: Path, media: Path) -> Iterator[Any]:
    service = {"allowed_local_media_path": str(media / "allowed"), **MEDIA_LIMITS}
    # blocks of 4 tokens: the repeated-image request hits the prefix cache through the image
    handle = launch_server(vl_dir, service, engine={"cache": {"block_size": 4, "num_blocks": 1024}})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def vl_http(vl_server) -> Iterator[httpx.Client]:
    with vl_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def client(vl_server) -> Any:
    return openai.OpenAI(base_url=vl_server.base_url + "/v1", api_key="unused", timeout=120)


def _image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_with_images_matches_hf(client, vl_server, vl_http, oracle, name):
    messages, images = CONVERSATIONS[name]
    expected = oracle.greedy(messages, images, MAX_TOKENS)
    prompt_len = oracle.prompt(messages, images)[0].shape[1]
    out = client.chat.completions.create(model=vl_server.model_name, messages=messages, **GREEDY)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert out.usage.prompt_tokens == prompt_len  # image pads count
    assert len(out.model_extra["prompt_token_ids"]) == prompt_len
    assert vl_http.post("/tokenize", json={"messages": messages}).json()["count"] == prompt_len
    stream = client.chat.completions.create(
        model=vl_server.model_name,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_repeated_image_hits_the_image_and_prefix_caches(client, vl_server, vl_http, oracle):
    image = random_image(84, 112, seed=11)
    first = [user_turn(image, "What is it?")]
    first[0]["content"][0]["image_url"]["detail"] = "high"  # the model's own resolution: accepted
    before = vl_http.get("/v1/admin/stats").json()
    outs = [
        client.chat.completions.create(model=vl_server.model_name, messages=first, **GREEDY) for _ in "ab"
    ]
    mid = vl_http.get("/v1/admin/stats").json()
    assert mid["num_image_encodes"] == before["num_image_encodes"] + 1  # once for both requests
    assert outs[0].choices[0].model_extra["token_ids"] == outs[1].choices[0].model_extra["token_ids"]
    assert outs[0].choices[0].model_extra["token_ids"] == oracle.greedy(first, [image], MAX_TOKENS)
    assert outs[1].usage.prompt_tokens_details.cached_tokens >= 12  # through the image's blocks
    # the same image behind other text: no prefix hit on it, its embedding comes from the image cache
    other = [user_turn("Another question first. Then:", image)]
    out = client.chat.completions.create(model=vl_server.model_name, messages=other, **GREEDY)
    after = vl_http.get("/v1/admin/stats").json()
    assert after["num_image_encodes"] == mid["num_image_encodes"]
    assert after["num_image_cache_hits"] > mid["num_image_cache_hits"]
    assert out.choices[0].model_extra["token_ids"] == oracle.greedy(other, [image], MAX_TOKENS)


def test_local_files_under_the_allowed_folder(client, vl_server, media, oracle):
    path = media / "allowed" / "small.png"
    expected = oracle.greedy([user_turn(SMALL, "Hi")], [SMALL], MAX_TOKENS)
    for n, url in ((1, path.as_uri()), (2, str(path))):
        messages = [{"role": "user", "content": [_image_part(url), {"type": "text", "text": "Hi"}]}]
        out = client.chat.completions.create(model=vl_server.model_name, messages=messages, n=n, **GREEDY)
        assert [c.model_extra["token_ids"] for c in out.choices] == [expected] * n


def _png_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _bad_cases(media: Path) -> list[tuple[str, list[dict[str, Any]], str]]:
    """(what, content parts of messages[1], the param the 400 names)."""
    from PIL import Image

    at = "messages.1.content.0.image_url"
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()
    big_pixels = _png_url(Image.new("RGB", (300, 300), (10, 20, 30)))  # tiny file, 90000 pixels
    big_bytes = _png_url(random_image(200, 200, seed=5))  # ~120 kB of noise
    return [
        ("corrupt bytes", [_image_part(corrupt)], at),
        ("wrong media type", [_image_part("data:text/plain;base64,aGVsbG8=")], at),
        ("not base64", [_image_part("data:image/png,rawbytes")], at),
        ("too many pixels", [_image_part(big_pixels)], at),
        ("too many bytes", [_image_part(big_bytes)], at),
        ("too many images", [_image_part(data_url(SMALL))] * 4, "messages.1.content.3.image_url"),
        ("outside the allow-list", [_image_part(str(media / "outside.png"))], at),
        ("traversal", [_image_part(str(media / "allowed" / ".." / "outside.png"))], at),
        ("network url", [_image_part("https://example.com/cat.png")], at),
        ("detail low", [_image_part(data_url(SMALL), detail="low")], at + ".detail"),
        ("detail unknown", [_image_part(data_url(SMALL), detail="ultra")], at + ".detail"),
        ("no image_url", [{"type": "image_url"}], at),
        (
            "placeholder in text",
            [_image_part(data_url(SMALL)), {"type": "text", "text": "<|image_pad|>"}],
            "messages",
        ),
        ("unknown part type", [{"type": "input_audio", "input_audio": {}}], "messages.1.content.0.type"),
    ]


def test_bad_images_are_400s_naming_the_part(vl_server, vl_http, media):
    good = {"model": vl_server.model_name, "max_tokens": 2}
    for what, parts, param in _bad_cases(media):
        messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": parts}]
        r = vl_http.post("/v1/chat/completions", json={**good, "messages": messages})
        assert r.status_code == 400, (what, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (what, error)
    r = vl_http.post("/v1/chat/completions", json={**good, "messages": CONVERSATIONS["1-image"][0]})
    assert r.status_code == 200, r.text


def test_text_prompts_through_the_vl_model(client, vl_server, vl_http, oracle):
    import torch

    prompt = "The mountains in winter are"
    out = client.completions.create(model=vl_server.model_name, prompt=prompt, **GREEDY)
    ids = oracle.tokenizer(prompt, return_tensors="pt")["input_ids"]
    gen = oracle.model.generation_config
    saved, gen.eos_token_id = gen.eos_token_id, None  # ignore_eos, as the request
    try:
        with torch.no_grad():
            ref = oracle.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
            )
    finally:
        gen.eos_token_id = saved
    assert out.choices[0].model_extra["token_ids"] == ref[0, ids.shape[1] :].tolist()
    assert out.usage.prompt_tokens == ids.shape[1]
    stats = vl_http.get("/v1/admin/stats").json()
    assert {"num_image_encodes", "num_image_cache_hits"} <= set(stats)


def test_text_model_refuses_image_parts(http):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, _image_part(data_url(SMALL))]}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages.0.content.1.type" and "takes no images" in error["message"]


def test_continue_final_message_with_echo(client, vl_server):
    messages = [
        user_turn(SMALL, "Describe it."),
        {"role": "assistant", "content": [{"type": "text", "text": "It is"}]},
    ]
    extra = {
        **GREEDY["extra_body"],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "echo": True,
    }
    out = client.chat.completions.create(
        model=vl_server.model_name, messages=messages, **{**GREEDY, "extra_body": extra}
    )
    assert out.choices[0].message.content.startswith("It is")
    assert len(out.choices[0].model_extra["token_ids"]) == MAX_TOKENS
