"""LoRA adapters through a real ``xllm serve`` and the ``openai`` client, as vLLM's own LoRA tests
use them (``tests/entrypoints/openai/models/test_models.py``, ``test_lora_adapters.py`` of vLLM 0.33):
adapters listed with their base as ``parent``, a request's ``model`` selecting one (tokens equal to HF +
PEFT), adapters loaded and unloaded at run time, and 100 adapters served round-robin with
``--max-loras 4``."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from xengine.tools.make_lora import make_lora
from xservice.commands.common import config_overrides

SOURCES = (
    ("attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("mlp4", 4, ("gate_proj", "up_proj", "down_proj")),
)
NUM_ADAPTERS = 100
PROMPT = [11, 57, 203, 991, 14, 400, 1201, 77, 5, 640, 1500, 32]


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-serving")
    made = {
        name: make_lora(model_dir, root / name, rank, targets, seed=i)
        for i, (name, rank, targets) in enumerate(SOURCES)
    }
    made["late"] = make_lora(model_dir, root / "late", 16, ("q_proj", "v_proj", "down_proj"), seed=7)
    return made


def _source(i: int) -> str:
    return SOURCES[i % len(SOURCES)][0]


@pytest.fixture(scope="module")
def server(launch_server: Any, model_dir: Path, adapters: dict[str, Path], tmp_path_factory) -> Iterator[Any]:
    """100 adapters (copies of two trained ones) under ``--max-loras 4``, runtime loading on."""
    root = tmp_path_factory.mktemp("lora-copies")
    modules = []
    for i in range(NUM_ADAPTERS):
        dst = root / f"tenant{i}"
        shutil.copytree(adapters[_source(i)], dst)
        modules.append(f"tenant{i}={dst}")
    lora = {"enable_lora": True, "lora_modules": modules, "max_loras": 4, "max_cpu_loras": 8}
    lora["allow_runtime_lora_updating"] = True
    handle = launch_server(model_dir, {}, engine={"lora": lora})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def oracle(model_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """HF + PEFT greedy tokens of ``PROMPT`` per source adapter (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out: dict[str | None, list[int]] = {}
    for name in (None, *adapters):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            ids = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8)
        out[name] = ids[0, len(PROMPT) :].tolist()
    return out


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _tokens(client: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    return resp.model, list(resp.choices[0].token_ids)


def test_the_flags_are_vllms() -> None:
    from xservice.cli import build_parser

    args = ["serve", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    args += [
        "--max-loras",
        "4",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "8",
        "--allow-runtime-lora-updating",
    ]
    got = config_overrides(build_parser().parse_args(args))["lora"]
    assert got == {
        "enable_lora": True,
        "lora_modules": ["a=/x", '{"name": "b", "path": "/y"}'],
        "max_loras": 4,
        "max_lora_rank": 32,
        "max_cpu_loras": 8,
        "allow_runtime_lora_updating": True,
    }


def test_models_list_adapters_with_their_parent(server: Any) -> None:
    models = _client(server).models.list().data
    base = models[0]
    assert base.id == server.model_name and getattr(base, "parent", None) is None
    adapters = {m.id: m for m in models[1:]}
    assert len(adapters) == NUM_ADAPTERS
    assert adapters["tenant3"].parent == server.model_name and adapters["tenant3"].root.endswith("tenant3")
    assert _client(server).models.retrieve("tenant7").parent == server.model_name


def test_model_selects_the_adapter(server: Any, oracle: dict[str | None, list[int]]) -> None:
    client = _client(server)
    assert _tokens(client, server.model_name) == (server.model_name, oracle[None])
    for i in (0, 1, 2, 51):
        assert _tokens(client, f"tenant{i}") == (f"tenant{i}", oracle[_source(i)])
    chat = client.chat.completions.create(
        model="tenant1", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == "tenant1"


def test_unknown_model_is_404(server: Any) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).completions.create(model="tenant-missing", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_round_robin_over_100_adapters(server: Any, oracle: dict[str | None, list[int]]) -> None:
    """Every adapter in turn, concurrently: at most 4 in a step, all answered, the right tokens."""
    client = openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300
    )

    async def one(i: int) -> tuple[int, list[int]]:
        resp = await client.completions.create(
            model=f"tenant{i}", prompt=PROMPT, max_tokens=8, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        return i, list(resp.choices[0].token_ids)

    async def run() -> list[tuple[int, list[int]]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(NUM_ADAPTERS)))
        finally:
            await client.close()

    for i, tokens in asyncio.run(run()):
        assert tokens == oracle[_source(i)], f"tenant{i}"


def test_load_and_unload_at_run_time(server: Any, adapters: dict[str, Path], oracle) -> None:
    http = httpx.Client(base_url=server.base_url, timeout=120)
    path = str(adapters["late"])
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in {m.id for m in _client(server).models.list().data}
    assert _tokens(_client(server), "late") == ("late", oracle["late"])
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    inplace = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path, "load_inplace": True}
    )
    assert inplace.status_code == 200
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"})
    assert missing.status_code == 404
    not_peft = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(Path(path).parent.parent)}
    )
    assert not_peft.status_code == 400 and "adapter_config.json" in not_peft.json()["error"]["message"]
    empty = http.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": path})
    assert empty.status_code == 400
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="late", prompt="hi", max_tokens=2)
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert (
        gone.status_code == 404
        and gone.json()["error"]["message"] == "The lora adapter 'late' cannot be found."
    )


def test_runtime_routes_are_off_by_default(launch_server: Any, model_dir: Path, adapters) -> None:
    handle = launch_server(
        model_dir, {}, engine={"lora": {"enable_lora": True, "lora_modules": [f"a={adapters['attn8']}"]}}
    )
    try:
        r = httpx.post(handle.base_url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x"})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        base = httpx.post(
            handle.base_url + "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2}
        )
        assert base.status_code == 200 and base.json()["model"] == "a"
    finally:
        handle.stop()


def test_metrics(server: Any) -> None:
    """vLLM's ``vllm:lora_requests_info`` and xllm's slot / folder loads on ``/metrics``."""
    _tokens(_client(server), "tenant5")
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        if 'vllm:lora_requests_info{max_lora="4"' in text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert 'vllm:lora_requests_info{max_lora="4"' in text
    assert f"xllm_lora_adapters {float(NUM_ADAPTERS)}" in text
    assert "xllm_lora_slot_loads_total" in text and "xllm_lora_disk_loads_total" in text


def test_cache_salt(server: Any) -> None:
    """vLLM's ``cache_salt``: the second request of a salt reuses the first's blocks, another salt none;
    an empty salt is a 400 naming the field."""
    client = _client(server)
    prompt = [7 + (i * 29) % 1900 for i in range(40)]

    def cached(salt: str) -> int:
        resp = client.completions.create(
            model="tenant9", prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached("s1") == 0
    assert cached("s2") == 0
    assert cached("s1") > 0
    with pytest.raises(openai.BadRequestError) as e:
        cached("")
    assert e.value.body["param"] == "cache_salt"


def test_odd_paths_are_404s(server: Any) -> None:
    http = httpx.Client(base_url=server.base_url, timeout=60)
    for path in ("bad\u0000path", "x" * 5000, "/dev/null"):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "odd", "lora_path": path})
        assert r.status_code == 404, (path[:20], r.text)
