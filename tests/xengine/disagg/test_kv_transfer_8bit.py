"""PD KV transfer of an 8-bit cache (``cache.kv_cache_dtype`` int8 / fp8) over a real Mooncake transfer
engine: the blocks move with their scales, so the decode instance streams the tokens of one 8-bit
instance; instances whose KV element types differ refuse to exchange blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.xengine.conftest import make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

pytest.importorskip("mooncake.engine")

MAX_TOKENS = 8


def _generate(engine, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
    return [t for d in run_to_completion(engine) for t in d.new_token_ids]


def _pd(prefill, decode, req_id: str, prompt: list[int]):
    first = _generate(prefill, f"{req_id}-p", prompt, 1)
    result = decode.kv_import(prefill.kv_export(f"{req_id}-x", prompt), prompt, pin_id=f"{req_id}-d")
    assert prefill.kv_release(f"{req_id}-x")
    return first + _generate(decode, f"{req_id}-d", prompt + first, MAX_TOKENS - 1), result


# (kv_cache_dtype, dtype, layout, prompt lengths): xTensor takes 512-token blocks for the tiny model's
# 8-bit rows (whole 4 KiB pages), so its prompts are longer
CASES = [
    ("int8", "float32", "paged", [40, 100]),
    ("fp8", "bfloat16", "paged", [40, 100]),
    ("int8", "float32", "xtensor", [600]),
]


@pytest.mark.parametrize("fmt,dtype,layout,lengths", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_pd_with_8bit_kv_streams_the_tokens_of_one_8bit_instance(
    tiny_qwen3: Path, fmt: str, dtype: str, layout: str, lengths: list[int]
) -> None:
    settings = dict(kv_cache_dtype=fmt, dtype=dtype, kv_layout=layout, max_model_len=1024, seed=0)
    num_blocks = 128 if layout == "paged" else 6
    prefill, decode, single = (make_engine(tiny_qwen3, num_blocks=num_blocks, **settings) for _ in range(3))
    assert decode.kv_setup.kv_caches[0].dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    block_size = decode.kv.block_size
    for i, prompt in enumerate(random_prompts(lengths, seed=5)):
        tokens, result = _pd(prefill, decode, f"r{i}", prompt)
        assert result.num_transferred_blocks == len(prompt) // block_size > 0
        region = decode.kv_transfer.start().region
        assert region.block_bytes == decode.kv_setup.kv_caches[0][0, 0].nbytes  # values and scales
        assert tokens == _generate(single, f"s{i}", prompt, MAX_TOKENS), f"prompt {i} differs"


def test_instances_with_different_kv_dtypes_refuse_to_exchange_blocks(tiny_qwen3: Path) -> None:
    settings = dict(block_size=16, num_blocks=32, max_model_len=256, seed=0)
    prefill = make_engine(tiny_qwen3, kv_cache_dtype="int8", **settings)
    prompt = random_prompts([48], seed=6)[0]
    _generate(prefill, "p", prompt, 1)
    source = prefill.kv_export("x", prompt)
    assert source.dtype == "int8"
    for other in ("fp8", "auto"):
        decode = make_engine(tiny_qwen3, kv_cache_dtype=other, **settings)
        free = decode.kv.num_free_blocks
        with pytest.raises(ValueError, match=r"KV layouts .* differ .*cache.kv_cache_dtype"):
            decode.kv_import(source, prompt, pin_id="d")
        assert decode.kv.num_free_blocks == free and decode.kv_transfer.num_pins == 0
    assert prefill.kv_release("x")
