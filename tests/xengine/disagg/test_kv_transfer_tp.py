"""PD between instances with different tensor-parallel layouts, over a real Mooncake transfer engine.

A TP = 2 prefill instance hands its prompt KV to a TP = 1 decode instance, and a TP = 1 prefill hands
it to a TP = 2 decode one: each importing rank reads, from the source ranks holding them, exactly its
KV heads (replicated heads: ``tests/memory/test_head_ranges.py``). The decode side's
greedy tokens equal one colocated engine's (HF's), and a prefix the decode side holds skips transfer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.xengine.conftest import make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams

pytest.importorskip("mooncake.engine")

SETTINGS = {"block_size": 16, "num_blocks": 96, "max_model_len": 512, "seed": 0, "num_threads": 1}
MAX_TOKENS = 8


def _generate(engine, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
    return [t for d in run_to_completion(engine) for t in d.new_token_ids]


# (prefill TP, decode TP): the single-process engine is built first (its layers stay plain while the
# other's tensor-parallel state is this process's)
LAYOUTS = [(2, 1), (1, 2)]  # two parallel instances cannot share a process (one torch.distributed
# world): tests/xservice/cluster/test_cluster_pd_tp.py runs them as separate instances


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), LAYOUTS, ids=[f"tp{p}-to-tp{d}" for p, d in LAYOUTS])
def test_pd_between_tp_layouts_gives_the_colocated_tokens(
    tiny_qwen3: Path, hf_oracle, prefill_tp: int, decode_tp: int
) -> None:
    order = sorted([("prefill", prefill_tp), ("decode", decode_tp)], key=lambda x: x[1])
    engines = {}
    try:
        for role, tp in order:
            engines[role] = make_engine(tiny_qwen3, tensor_parallel_size=tp, **SETTINGS)
        prefill, decode = engines["prefill"], engines["decode"]
        oracle = hf_oracle("qwen3")
        shared = random_prompts([40], seed=5)[0]
        prompts = random_prompts([20, 70], seed=6) + random_prompts([25], seed=7, prefix=shared)
        prompts.append(shared + prompts[2][len(shared) :] + [9, 9, 9])
        results = []
        for i, prompt in enumerate(prompts):
            first = _generate(prefill, f"p{i}", prompt, 1)
            source = prefill.kv_export(f"x{i}", prompt)
            assert (source.ranks is not None) == (prefill_tp > 1)
            result = decode.kv_import(source, prompt, pin_id=f"d{i}")
            assert prefill.kv_release(f"x{i}")
            rest = _generate(decode, f"d{i}", prompt + first, MAX_TOKENS - 1)
            assert first + rest == oracle.greedy(prompt, MAX_TOKENS), f"prompt {i}"
            assert result.num_blocks == len(prompt) // 16
            results.append(result)
        assert results[1].num_transferred_blocks == 4 and results[1].num_bytes > 0
        assert results[3].num_hit_blocks >= 2  # the shared prefix was imported before: no transfer for it
        assert decode.kv_transfer.num_pins == 0 and prefill.kv_transfer.num_pins == 0
    finally:
        for engine in reversed(list(engines.values())):
            engine.shutdown()
