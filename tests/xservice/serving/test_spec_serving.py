"""Speculative decoding served by ``xllm serve`` (the ``speculative_config`` section of its YAML): the
``openai`` client gets the tokens of the engine without speculation, and ``/v1/admin/stats`` and
``/metrics`` (xllm's names and vLLM's ``vllm:spec_decode_*``) count the drafts proposed and accepted."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.spec_checkpoints import make_bigram_copy
from tests.xengine.conftest import random_prompts
from tests.xservice.conftest import start_server
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def bigram(make_model_dir, tmp_path_factory):
    return make_bigram_copy(make_model_dir("qwen3"), tmp_path_factory.mktemp("bigram-serve"))


@pytest.fixture(scope="module")
def served(bigram):
    handle = start_server(bigram, engine={"speculative_config": SPEC})
    yield handle
    handle.stop()


def test_served_tokens_match_plain_decoding_and_drafts_are_counted(served, bigram) -> None:
    plain = LLM(str(bigram), block_size=16)
    heads = random_prompts([6, 12], seed=91)
    chains = plain.generate(
        heads, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    prompts = [h + list(c.outputs[0].token_ids) + h for h, c in zip(heads, chains)]
    expected = plain.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for prompt, want in zip(prompts, expected):
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True,
            "return_token_ids": True},
        )  # fmt: skip
        assert out.choices[0].token_ids == list(want.outputs[0].token_ids)
    with served.client() as http:
        stats = http.get("/v1/admin/stats").json()
        metrics = http.get("/metrics").text
    spec = stats["spec_decode"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4
    assert spec["num_accepted_tokens"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    assert sum(spec["accepted_per_pos"]) == spec["num_accepted_tokens"]
    values = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert values[("xllm_spec_decode_num_accepted_tokens", None)] == spec["num_accepted_tokens"]
    assert values[("vllm:spec_decode_num_draft_tokens_total", None)] == spec["num_draft_tokens"]
    assert values[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0")] == spec["accepted_per_pos"][0]


def test_a_request_opts_out_with_speculative_false(served, bigram) -> None:
    heads = random_prompts([8], seed=93)
    plain = LLM(str(bigram), block_size=16)
    chain = plain.generate(
        heads, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    prompt = heads[0] + list(chain[0].outputs[0].token_ids) + heads[0]  # lookup would find drafts
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def drafts() -> int:
        with served.client() as http:
            return http.get("/v1/admin/stats").json()["spec_decode"]["num_drafts"]

    before = drafts()
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True, "speculative": False, "return_token_ids": True},
    )  # fmt: skip
    assert len(out.choices[0].token_ids) == 16 and drafts() == before
    client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert drafts() > before


def test_an_eagle3_head_served_keeps_the_tokens(make_model_dir, tmp_path_factory) -> None:
    """``xllm serve`` with an EAGLE-3 head from a folder of its own (``speculative_config.model``): the
    ``openai`` client streams the tokens of the engine without speculation, and the head drafted."""
    from xengine.tools.eagle_checkpoint import make_eagle_head

    target = make_model_dir("qwen3")
    head = make_eagle_head(target, tmp_path_factory.mktemp("eagle3-serve"), "eagle3", aux_layers=[0, 2, 3])
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(head)}
    prompts = random_prompts([9, 30], seed=92)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [
        list(o.outputs[0].token_ids)
        for o in LLM(str(target), block_size=16).generate(prompts, greedy, use_tqdm=False)
    ]
    handle = start_server(target, engine={"speculative_config": spec})
    try:
        client = openai.OpenAI(base_url=handle.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for prompt, want in zip(prompts, expected):
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            got = [
                t for chunk in stream for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])
            ]
            assert got == want
        with handle.client() as http:
            stats = http.get("/v1/admin/stats").json()["spec_decode"]
        assert stats["method"] == "eagle3" and stats["num_draft_tokens"] > 0
    finally:
        handle.stop()
