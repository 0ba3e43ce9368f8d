"""vLLM's ``prompt_embeds`` on ``/v1/completions`` through a real ``xllm serve`` and the ``openai`` client,
as vLLM's ``test_completion_with_prompt_embeds.py`` uses it: the same tokens as the same prompt given as
token ids, several at once, streamed, with logprobs, mixed with text prompts (embeddings first), under a
LoRA adapter; safe loading (a pickle that would run code is a 400 and runs nothing); every misuse a 400
naming the field."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from xengine.tools.make_lora import make_lora

PROMPTS = [[11, 57, 203, 991, 14, 400, 1201, 77], [5, 640, 1500, 32, 9, 9, 310]]


def _encode(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds(model_dir: Path) -> list[str]:
    """The prompts' token embeddings as HF computes them (what a client hands in)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [_encode(model.get_input_embeddings()(torch.tensor(p))) for p in PROMPTS]


@pytest.fixture(scope="module")
def server(launch_server: Any, model_dir: Path, tmp_path_factory) -> Iterator[Any]:
    adapter = make_lora(model_dir, tmp_path_factory.mktemp("embeds-lora") / "a", 8)
    engine = {
        "model": {"enable_prompt_embeds": True},
        "lora": {"enable_lora": True, "lora_modules": [f"a={adapter}"]},
    }
    handle = launch_server(model_dir, {}, engine=engine)
    yield handle
    handle.stop()


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _create(server: Any, model: str | None = None, **kw: Any) -> Any:
    extra = {"return_token_ids": True, "ignore_eos": True, **kw.pop("extra_body", {})}
    return _client(server).completions.create(
        model=model or server.model_name, max_tokens=6, temperature=0, extra_body=extra, **kw
    )


@pytest.mark.parametrize("model", [None, "a"])
def test_embeddings_give_the_prompts_tokens(server: Any, embeds: list[str], model: str | None) -> None:
    by_ids = _create(server, model, prompt=PROMPTS)
    want = [list(c.token_ids) for c in by_ids.choices]
    one = _create(server, model, prompt=None, extra_body={"prompt_embeds": embeds[0]})
    assert list(one.choices[0].token_ids) == want[0] and one.choices[0].prompt_logprobs is None
    both = _create(server, model, prompt=None, extra_body={"prompt_embeds": embeds})
    assert [list(c.token_ids) for c in both.choices] == want
    assert both.usage.prompt_tokens == sum(map(len, PROMPTS))
    mixed = _create(server, model, prompt=PROMPTS[1], extra_body={"prompt_embeds": embeds[0]})
    assert [list(c.token_ids) for c in mixed.choices] == want  # the embeddings' choice first (vLLM's order)


def test_stream_and_logprobs(server: Any, embeds: list[str]) -> None:
    single = _create(server, prompt=None, extra_body={"prompt_embeds": embeds[0]}).choices[0].text
    stream = _client(server).completions.create(
        model=server.model_name, prompt=None, max_tokens=6, temperature=0, stream=True,
        extra_body={"prompt_embeds": embeds[0], "ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == single
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    resp = _create(server, prompt=None, logprobs=1, extra_body={"prompt_embeds": embeds[0]})
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and len(lp.tokens) == 6 and all(len(t) >= 1 for t in lp.top_logprobs)


def test_bad_embeddings_are_400s(server: Any, embeds: list[str], model_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))

    cases = {
        "invalid_base64": "not valid base64",
        _encode(Exploit()): "not part of a saved tensor",
        _encode(torch.zeros(4, 7)): "hidden size",
        _encode(torch.zeros(2, 3, 4)): "tensor",
        _encode(torch.full((3, 64), float("nan"))): "NaN",
        _encode(torch.zeros(3, 64, dtype=torch.float64)): "not part of a saved tensor",
    }
    for value, why in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            _create(server, prompt=None, extra_body={"prompt_embeds": value})
        assert e.value.body["param"] == "prompt_embeds" and why in e.value.body["message"], e.value.body
    assert not marker.exists()  # nothing of the pickle ran
    with pytest.raises(openai.BadRequestError) as e:
        _create(server, prompt=None)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        _create(server, prompt=None, extra_body={"prompt_embeds": []})
    assert len(_create(server, prompt="Hello", extra_body={"prompt_embeds": []}).choices) == 1  # as vLLM
    with pytest.raises(openai.BadRequestError) as e:
        _create(server, prompt=None, echo=True, extra_body={"prompt_embeds": embeds[0]})
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"prompt_embeds": embeds[0]},
        )
    assert e.value.body["param"] == "prompt_embeds"


def test_off_by_default(launch_server: Any, model_dir: Path, embeds: list[str]) -> None:
    handle = launch_server(model_dir, {})
    try:
        with pytest.raises(openai.BadRequestError) as e:
            _create(handle, prompt=None, extra_body={"prompt_embeds": embeds[0]})
        assert (
            e.value.body["param"] == "prompt_embeds" and "--enable-prompt-embeds" in e.value.body["message"]
        )
    finally:
        handle.stop()
