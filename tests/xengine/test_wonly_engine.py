"""The engine with weight-only ``model.quantization=int8`` / ``int4``: a request gets the same tokens
whatever shares its steps (the kernel's rows are independent of their batch, bit for bit), in float32
and bfloat16. The arithmetic is checked against its torch reference in
``tests/xengine/models/test_wonly_model.py``."""

from __future__ import annotations

import pytest

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_TOKENS = 10


@pytest.mark.skipif(
    kernel_library("panel_gemm_wonly") is None,
    reason=f"weight-only panel GEMM unavailable here: {unavailable_reason('panel_gemm_wonly')}",
)
@pytest.mark.parametrize(
    ("scheme", "dtype"),
    [
        ("int8", "float32"),
        ("int4", "float32"),
        pytest.param(
            "int4",
            "bfloat16",
            # the unquantized bf16 layers (the LM head) need the bf16 panel GEMM to be batch-invariant:
            # torch's bf16 GEMM, where the CPU lacks avx512_bf16, blocks its rows by the batch
            marks=pytest.mark.skipif(
                kernel_library("panel_gemm_bf16") is None,
                reason=f"bf16 panel GEMM unavailable here: {unavailable_reason('panel_gemm_bf16')}",
            ),
        ),
    ],
)
def test_weight_only_tokens_do_not_depend_on_the_batch(make_model_dir, scheme: str, dtype: str) -> None:
    llm = LLM(
        str(make_model_dir("qwen3")), quantization=scheme, dtype=dtype, max_num_seqs=8, kv_layout="paged"
    )
    prompts = random_prompts([3, 40, 17, 90, 8, 61], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == MAX_TOKENS for t in together)
