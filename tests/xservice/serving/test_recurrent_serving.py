"""A recurrent hybrid model (the tiny Qwen3-Next: gated DeltaNet and gated attention) served by
``xllm serve``: the ``openai`` client gets the offline engine's tokens, a follow-up prompt resumes
from a state snapshot, and ``/v1/admin/stats`` and ``/metrics`` show the state pool beside the KV pool."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.xengine.conftest import random_prompts
from tests.xservice.conftest import start_server
from xengine.api.messages import SamplingParams
from xengine.llm import LLM


@pytest.fixture(scope="module")
def qwen3_next(make_model_dir):
    return make_model_dir("qwen3_next")


@pytest.fixture(scope="module")
def served(qwen3_next):
    handle = start_server(qwen3_next)
    yield handle
    handle.stop()


def test_served_tokens_match_offline_and_the_state_pool_is_reported(served, qwen3_next) -> None:
    first = random_prompts([150], seed=81)[0]
    prompts = [first, first[:140] + random_prompts([6], seed=82)[0]]
    offline = LLM(str(qwen3_next), block_size=16, enable_prefix_caching=False).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for prompt, expected in zip(prompts, offline):
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True,
            "return_token_ids": True},
        )  # fmt: skip
        assert out.choices[0].token_ids == expected.outputs[0].token_ids
    with served.client() as http:
        stats = http.get("/v1/admin/stats").json()
        metrics = http.get("/metrics").text
    pool = stats["state_pool"]
    assert pool["num_layers"] == 3 and pool["bytes_per_slot"] > 0
    assert pool["num_free_seq_slots"] == pool["num_seq_slots"]  # every request ended: all released
    assert pool["num_snapshot_hits"] == 1 and stats["prefix_cache_hits"] == 128  # snapshots every 64
    gauges = {
        s.labels["pool"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "xllm_kv_pool_free_blocks"
        for s in family.samples
    }
    assert gauges["recurrent_state"] == pool["num_free_seq_slots"]
    assert gauges["full_attention"] == stats["num_free_blocks"]
