"""Partial graph mode (``graph/partial.py``): one compiled graph per token-count bucket, attention
eager; padding to the bucket is invisible; nothing recompiles after start-up; larger steps run eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graph.base import create_graph_runner, graph_modes
from tests.xengine.conftest import make_engine, random_prompts, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams


def test_full_graphs_are_refused_where_no_platform_offers_them() -> None:
    assert graph_modes("cpu") == ["eager", "partial"]
    with pytest.raises(ValueError, match="not available on cpu"):
        create_graph_runner("full", "cpu", lambda ids, pos: ids)


def test_partial_matches_eager_and_never_recompiles(tiny_qwen3: Path) -> None:
    prompts = random_prompts([1, 5, 9, 30, 2, 70], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in ("eager", "partial"):
        engine = make_engine(
            tiny_qwen3, graph_mode=mode, graph_batch_sizes="1,4", max_model_len=256, max_num_batched_tokens=64,
            num_blocks=128,
        )  # fmt: skip
        for i, p in enumerate(prompts):
            engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=p, params=params))
        deltas = run_to_completion(engine)
        outs[mode] = {
            r: ([t for d in deltas if d.req_id == r for t in d.new_token_ids],
                [lp for d in deltas if d.req_id == r for lp in (d.new_logprobs or [])])
            for r in {d.req_id for d in deltas}
        }  # fmt: skip
        stats = engine.get_stats().graph
        assert stats.mode == mode
    assert stats.buckets == [1, 4] and set(stats.capture_s) == {1, 4}
    assert stats.num_replays > 0 and stats.num_eager_steps > 0  # 6 decodes: padded... prefills: eager
    assert stats.num_compiles == 2 and stats.num_recompiles_after_warmup == 0
    for r, (toks, lps) in outs["eager"].items():
        got_toks, got_lps = outs["partial"][r]
        assert got_toks == toks
        torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(lps), rtol=1e-4, atol=1e-4)


def test_padding_rows_neither_attend_nor_write_the_cache(tiny_qwen3: Path) -> None:
    """3 decodes padded to a bucket of 4: the padding row must not touch the KV pool."""
    engine = make_engine(
        tiny_qwen3, graph_mode="partial", graph_batch_sizes="4", max_model_len=128, num_blocks=32
    )
    for i, p in enumerate(random_prompts([3, 3, 3], seed=5)):
        engine.add_request(
            AddRequest(
                req_id=f"r{i}", prompt_token_ids=p, params=SamplingParams(temperature=0.0, max_tokens=6)
            )
        )
    engine.step()  # prefill (9 tokens: eager)
    before = [c.clone() for c in engine.runner.kv_caches]
    engine.step()  # 3 decodes, padded to 4
    assert engine.get_stats().graph.num_replays == 1
    tables = {b for t in engine.kv.block_tables.values() for b in t}
    for old, new in zip(before, engine.runner.kv_caches):
        untouched = [b for b in range(new.shape[1]) if b not in tables]
        assert torch.equal(old[:, untouched], new[:, untouched])
