"""``max_model_len`` against the positions a checkpoint supports: refused at start-up past
``max_position_embeddings``, unless the checkpoint's rope scaling extends the context, in which case
prompts past ``max_position_embeddings`` run (and match HF)."""

from __future__ import annotations

import pytest

from tests.xengine.conftest import HFOracle, random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_POSITION = 4096  # of the tiny checkpoints
LONG = 2 * MAX_POSITION
NUM_BLOCKS = LONG // 16 + 8  # the KV pool must not be what limits max_model_len
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
THETA = 10000.0
ROPE = {
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": MAX_POSITION},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.fixture(scope="module")
def rope_variant(make_config_variant):
    def _get(name: str):
        return make_config_variant(f"rope-{name}", {"rope_parameters": {"rope_theta": THETA, **ROPE[name]}})

    return _get


def test_past_max_position_embeddings_is_refused_with_the_fix(tiny_qwen3):
    fix = rf"max_model_len {LONG} .* {MAX_POSITION} positions .*lower --max-model-len .* to {MAX_POSITION} or less"
    with pytest.raises(ValueError, match=fix):
        LLM(str(tiny_qwen3), max_model_len=LONG, num_blocks=NUM_BLOCKS)
    assert (
        LLM(str(tiny_qwen3), max_model_len=MAX_POSITION, num_blocks=NUM_BLOCKS).engine.max_model_len
        == MAX_POSITION
    )


def test_past_what_the_rope_scaling_allows_is_refused(rope_variant):
    with pytest.raises(
        ValueError, match=rf"max_model_len {2 * LONG} .* {LONG} positions .*yarn rope_scaling"
    ):
        LLM(str(rope_variant("yarn")), max_model_len=2 * LONG, num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("name", list(ROPE))
def test_rope_scaling_that_allows_it_serves_past_max_position_embeddings(rope_variant, name):
    llm = LLM(str(rope_variant(name)), max_model_len=LONG, num_blocks=NUM_BLOCKS)
    assert llm.engine.max_model_len == LONG
    prompt = random_prompts([MAX_POSITION + 4], seed=5)[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    if name != "dynamic":  # HF sizes dynamic NTK per batch, we once for max_model_len
        assert out.token_ids == HFOracle(rope_variant(name)).greedy(prompt, 4)
    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_dynamic_ntk_allows_any_length(rope_variant):
    llm = LLM(str(rope_variant("dynamic")), max_model_len=3 * MAX_POSITION, num_blocks=3 * NUM_BLOCKS)
    assert llm.engine.max_model_len == 3 * MAX_POSITION
    prompt = random_prompts([LONG + 4], seed=6)[0]  # past max_position_embeddings * factor too
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
