"""An emulated instance (``device: emulated`` with a device profile) served by ``xllm serve`` behaves as a
real one to the ``openai`` client: chat and completions, streaming, ``n``, stop strings, ``max_tokens``,
usage and a stream cancelled midway; its tokens are the offline emulated engine's."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.xservice.conftest import start_server
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

BASE_MS = 8.0
PROFILE = {
    "name": "serve-test",
    "base_ms": BASE_MS,
    "tokens_ms": [[1, 0.0], [512, 20.0]],
    "kv_capacity_tokens": 8192,
}


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("emulated-profile") / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


@pytest.fixture(scope="module")
def served(model_dir, profile):
    handle = start_server(model_dir, engine={"device": {"device": "emulated", "device_profile": profile}})
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tokens_equal_the_offline_emulated_engine(client, model_dir, profile) -> None:
    llm = LLM(
        str(model_dir), device="emulated", device_profile=profile, block_size=16, seed=0, max_model_len=256
    )
    prompt = "Once upon a time in a land far away"
    want = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    out = client.completions.create(
        model="xllm-tiny", prompt=prompt, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert out.choices[0].token_ids == list(want[0].outputs[0].token_ids)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 24


def test_chat_stream_n_stop_and_usage(client) -> None:
    messages = [{"role": "user", "content": "Tell me a story about a fox."}]
    whole = client.chat.completions.create(
        model="xllm-tiny", messages=messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens == 20 and whole.usage.prompt_tokens > 5
    stream = client.chat.completions.create(
        model="xllm-tiny", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 20
    sampled = client.chat.completions.create(
        model="xllm-tiny", messages=messages, max_tokens=12, temperature=1.0, n=3, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(sampled.choices) == 3 and len({c.message.content for c in sampled.choices}) > 1
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.chat.completions.create(
        model="xllm-tiny", messages=messages, max_tokens=20, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content
    assert text.startswith(cut.choices[0].message.content)


def test_a_cancelled_stream_frees_the_instance(client, served) -> None:
    stream = client.completions.create(
        model="xllm-tiny", prompt="Count:", max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    with served.client() as http:
        for _ in range(100):
            if http.get("/v1/admin/stats").json()["num_running"] == 0:
                break
            time.sleep(0.05)
        assert http.get("/v1/admin/stats").json()["num_running"] == 0
    out = client.completions.create(model="xllm-tiny", prompt="Again", max_tokens=4)
    assert out.usage.completion_tokens == 4 or out.choices[0].finish_reason == "stop"
