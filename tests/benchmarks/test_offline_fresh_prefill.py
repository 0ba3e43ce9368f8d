"""The offline throughput runs time what a user's first batch costs: every repeat prefills its prompts
again instead of finding them in the prefix cache the previous repeat filled."""

from __future__ import annotations

import random
from pathlib import Path

from benchmarks.offline.xllm_throughput import EngineArgs, xllm_throughput


def test_every_repeat_prefills_its_prompts(tiny_qwen3: Path) -> None:
    llm = EngineArgs(max_num_seqs=4, max_model_len=256, num_threads=1).make_llm(str(tiny_qwen3))
    assert llm.engine.get_stats().prefix_cache_hits == 0
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 200) for _ in range(64)] for _ in range(3)]
    out = xllm_throughput(llm, prompts, output_len=2, repeats=3)
    stats = llm.engine.get_stats()
    assert out["repeats"] == 3 and out["num_output_tokens"] == 6
    assert stats.prefix_cache_queries > 0  # the cache is on and was asked ...
    assert stats.prefix_cache_hits == 0  # ... and never found a repeat's prompts
