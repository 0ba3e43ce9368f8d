"""Beam search over ``/v1/completions`` and the generative-recommendation API, on a real server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.xengine.beam.test_beam_catalog import brute_force, make_catalog


@pytest.fixture(scope="module")
def rec_server(model_dir: Path, launch_server: Callable[..., Any]) -> Iterator[Any]:
    handle = launch_server(model_dir, {"max_n": 16})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(rec_server: Any) -> Iterator[httpx.Client]:
    with rec_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_completions_beam_search_equals_hf(client: httpx.Client, hf_model: Any, tokenizer: Any) -> None:
    prompt = [17, 300, 42, 999, 5, 1200, 64, 7]
    body = {
        "prompt": prompt,
        "max_tokens": 8,
        "use_beam_search": True,
        "beam_width": 4,
        "n": 4,
        "ignore_eos": True,
        "length_penalty": 1.0,
        "skip_special_tokens": False,
    }
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            num_beams=4,
            do_sample=False,
            num_return_sequences=4,
            max_new_tokens=8,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = [tokenizer.decode(row[len(prompt) :], skip_special_tokens=False) for row in out.sequences.tolist()]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == want
    assert [c["score"] for c in choices] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    # a plain request has no beam fields
    plain = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert "score" not in plain["choices"][0]


def test_completions_beam_errors(client: httpx.Client) -> None:
    base = {"prompt": "hi", "max_tokens": 4, "use_beam_search": True}
    for extra, param in [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2, "n": 3}, "n"),
        ({"beam_width": 999}, "beam_width"),
    ]:
        resp = client.post("/v1/completions", json={**base, **extra})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


def test_rec_catalog_and_generate_equal_brute_force(client: httpx.Client, hf_model: Any) -> None:
    items = make_catalog(20, seed=3)
    resp = client.post("/v1/rec/catalogs", json={"name": "shop", "items": items})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"object": "rec.catalog", "name": "shop", "num_items": 20, "item_len": 3}
    listed = client.get("/v1/rec/catalogs").json()
    assert [c["name"] for c in listed["data"]] == ["shop"]
    prompt = [9, 81, 400, 33, 1500, 12]
    body = {"prompt": prompt, "catalog": "shop", "beam_width": 20, "top_k": 20, "num_items": 5}
    resp = client.post("/v1/rec/generate", json=body)
    assert resp.status_code == 200, resp.text
    got = resp.json()["items"]
    want = brute_force(hf_model, prompt, items)[:5]
    assert [g["item"] for g in got] == [w[1] for w in want]
    assert [g["score"] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    # a narrow search still returns only catalog items
    narrow = client.post(
        "/v1/rec/generate", json={**body, "beam_width": 3, "top_k": 2, "num_items": 3}
    ).json()
    assert len(narrow["items"]) == 3 and all(it["item"] in items for it in narrow["items"])


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/rec/generate", {"prompt": [5], "catalog": "missing", "beam_width": 4}, 404, "catalog"),
        ("/v1/rec/generate", {"prompt": [5], "catalog": "shop2", "beam_width": 0}, 400, "beam_width"),
        (
            "/v1/rec/generate",
            {"prompt": [5], "catalog": "shop2", "beam_width": 4, "num_items": 5},
            400,
            "num_items",
        ),
        ("/v1/rec/generate", {"prompt": [5], "catalog": "shop2", "beam_width": 4, "top_k": 0}, 400, "top_k"),
        ("/v1/rec/catalogs", {"name": "x", "items": [[1, 2], [3]]}, 400, "items"),
        ("/v1/rec/catalogs", {"name": "x", "items": [[1, 5000]]}, 400, "items"),
        ("/v1/rec/catalogs", {"name": "x", "items": []}, 400, "items"),
        ("/v1/rec/catalogs", {"name": "bad name", "items": [[1]]}, 400, "name"),
    ],
)
def test_rec_errors(client: httpx.Client, path: str, body: dict, status: int, param: str) -> None:
    client.post("/v1/rec/catalogs", json={"name": "shop2", "items": [[3, 4, 5], [3, 4, 6]]})
    resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
