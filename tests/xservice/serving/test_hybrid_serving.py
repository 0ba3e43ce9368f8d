"""A sliding-window model (the tiny Gemma 3) served by ``xllm serve``: the ``openai`` client gets the
offline engine's tokens for prompts several windows long, a repeated prompt hits the prefix cache,
and ``/v1/admin/stats`` and ``/metrics`` show both KV pools."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.xengine.conftest import random_prompts
from tests.xservice.conftest import start_server
from xengine.api.messages import SamplingParams
from xengine.llm import LLM


@pytest.fixture(scope="module")
def gemma3(make_model_dir):
    return make_model_dir("gemma3")


@pytest.fixture(scope="module")
def served(gemma3):
    handle = start_server(gemma3)
    yield handle
    handle.stop()


def test_served_tokens_match_offline_and_both_pools_are_reported(served, gemma3) -> None:
    prompts = random_prompts([150, 90], seed=71)
    offline = LLM(str(gemma3), block_size=16).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for _ in range(2):  # the second time through the prefix cache
        for prompt, expected in zip(prompts, offline):
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True,
                "return_token_ids": True},
            )  # fmt: skip
            assert out.choices[0].token_ids == expected.outputs[0].token_ids
    with served.client() as http:
        stats = http.get("/v1/admin/stats").json()
        metrics = http.get("/metrics").text
    pool = stats["window_pool"]
    assert pool["window"] == 32 and pool["num_layers"] == 3
    assert pool["num_free_blocks"] == pool["num_total_blocks"]  # every request ended: all released
    assert stats["prefix_cache_hits"] > 0
    gauges = {
        s.labels["pool"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "xllm_kv_pool_free_blocks"
        for s in family.samples
    }
    assert gauges["sliding_window"] == pool["num_free_blocks"]
    assert gauges["full_attention"] == stats["num_free_blocks"]
