"""The engine with ``model.quantization=w8a8``: int8 linear layers (the LM head in the model's dtype),
over both KV layouts and async scheduling, in float32 and bfloat16. The arithmetic is checked against
its torch reference in ``tests/xengine/models/test_w8a8_model.py``; here the whole engine must give a
request the same tokens whatever shares its steps (the int8 sums are exact and per row), and an
unknown quantization is refused when the engine is built."""

from __future__ import annotations

import pytest

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_TOKENS = 12
MODES = {
    "paged": dict(kv_layout="paged", async_scheduling="off"),
    "xtensor+async": dict(kv_layout="xtensor", async_scheduling="on", num_blocks=512),
}


@pytest.mark.skipif(
    kernel_library("panel_gemm_int8") is None,
    reason=f"int8 panel GEMM unavailable here: {unavailable_reason('panel_gemm_int8')}",
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", list(MODES))
def test_w8a8_tokens_do_not_depend_on_the_batch(make_model_dir, mode: str, dtype: str) -> None:
    llm = LLM(str(make_model_dir("qwen3")), quantization="w8a8", dtype=dtype, max_num_seqs=8, **MODES[mode])
    prompts = random_prompts([3, 40, 17, 90, 8, 61], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == MAX_TOKENS for t in together)


def test_unknown_quantization_is_refused(make_model_dir) -> None:
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(make_model_dir("qwen3")), quantization="int3")


@pytest.mark.skipif(
    kernel_library("panel_gemm_int8") is None,
    reason=f"int8 panel GEMM unavailable here: {unavailable_reason('panel_gemm_int8')}",
)
def test_w8a8_partial_graphs_give_the_eager_tokens(make_model_dir) -> None:
    """The packed int8 layers are opaque ops inside the captured graph: in float32 the graph replays
    give the eager tokens."""
    prompts = random_prompts([3, 40, 17, 90, 8, 61], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    model = str(make_model_dir("qwen3"))
    eager = LLM(model, quantization="w8a8", graph_mode="eager")
    graphs = LLM(model, quantization="w8a8", graph_mode="partial", graph_batch_sizes="8", max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)] == expected
    assert graphs.engine.get_stats().graph.num_replays > 0
