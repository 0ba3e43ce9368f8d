"""``/v1/embeddings`` through the real server with the ``openai`` client, against HF ``AutoModel`` on the
same weights (last token's final hidden state, L2-normalised); batch jobs; bad input is a 400."""

from __future__ import annotations

import base64
import gc
import json
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Iterator[Any]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield model
    del model
    gc.collect()


@torch.no_grad()
def hf_embedding(model: Any, ids: list[int], dims: int | None = None) -> torch.Tensor:
    last = model(torch.tensor([ids])).last_hidden_state[0, -1]  # after the final norm
    return torch.nn.functional.normalize(last[:dims] if dims else last, dim=0)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_float_and_base64_match_hf(client: openai.OpenAI, server, hf_model, tokenizer) -> None:
    out = client.embeddings.create(model=server.model_name, input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model=server.model_name, input=TEXTS, encoding_format="base64")
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert out.object == "list" and out.model == server.model_name
    assert [d.index for d in out.data] == [0, 1, 2] and {d.object for d in out.data} == {"embedding"}
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    for d, p, prompt_ids in zip(out.data, packed.data, ids):
        ref = hf_embedding(hf_model, prompt_ids)
        assert len(d.embedding) == ref.shape[0]
        assert torch.allclose(torch.tensor(d.embedding), ref, atol=1e-5)
        raw = base64.b64decode(p.embedding)  # little-endian float32, as OpenAI
        assert len(raw) == 4 * ref.shape[0]
        assert array("f", raw).tolist() == pytest.approx(array("f", d.embedding).tolist(), abs=0)


def test_token_inputs_and_dimensions(client: openai.OpenAI, server, hf_model) -> None:
    prompts = [[5, 99, 7, 1000, 42], [8] * 40]
    one = client.embeddings.create(model=server.model_name, input=prompts[0], encoding_format="float")
    many = client.embeddings.create(
        model=server.model_name, input=prompts, dimensions=32, encoding_format="float"
    )
    assert torch.allclose(torch.tensor(one.data[0].embedding), hf_embedding(hf_model, prompts[0]), atol=1e-5)
    for d, p in zip(many.data, prompts):
        assert len(d.embedding) == 32  # Matryoshka: the leading 32, renormalised
        assert torch.allclose(torch.tensor(d.embedding), hf_embedding(hf_model, p, 32), atol=1e-5)


def test_long_input_and_a_prefix_hit(http: httpx.Client, hf_model) -> None:
    """A 250-token input (the server's context is 256), twice: the second time from the prefix cache
    (last-token pooling needs only the last position, which a hit always leaves to compute)."""
    ids = [(7 * i) % 2000 + 3 for i in range(250)]
    first = http.post("/v1/embeddings", json={"input": ids}).json()
    hits = http.get("/v1/admin/stats").json()["prefix_cache_hits"]
    second = http.post("/v1/embeddings", json={"input": ids, "user": "ignored"}).json()
    assert http.get("/v1/admin/stats").json()["prefix_cache_hits"] - hits == 240  # 15 blocks of 16
    ref = hf_embedding(hf_model, ids)
    for body in (first, second):
        assert torch.allclose(torch.tensor(body["data"][0]["embedding"]), ref, atol=1e-5)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [7] * 257}, "input"),
        ({"input": [5000]}, "input"),
        ({"input": "x" * 200_000}, None),  # over the body limit: 413
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 100_000}, "dimensions"),
        ({"input": "hi", "model": "other"}, "model"),
        ({"input": "hi", "truncate": True}, "truncate"),
    ],
)
def test_bad_input(http: httpx.Client, body: dict[str, Any], param: str | None) -> None:
    resp = http.post("/v1/embeddings", json=body)
    if param is None:
        assert resp.status_code == 413
        return
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    assert resp.json()["error"]["param"] == param


def test_batch_job(http: httpx.Client, hf_model, tokenizer) -> None:
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
        for i, text in enumerate(TEXTS[:2])
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    file_id = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}).json()[
        "id"
    ]
    batch = http.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
    ).json()
    deadline = time.monotonic() + 120
    while batch["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = http.get(f"/v1/batches/{batch['id']}").json()
    assert batch["status"] == "completed", batch
    output = http.get(f"/v1/files/{batch['output_file_id']}/content").text
    records = {r["custom_id"]: r for r in map(json.loads, output.splitlines())}
    for i, text in enumerate(TEXTS[:2]):
        body = records[f"e{i}"]["response"]["body"]
        ref = hf_embedding(hf_model, tokenizer.encode(text))
        assert torch.allclose(torch.tensor(body["data"][0]["embedding"]), ref, atol=1e-5)
