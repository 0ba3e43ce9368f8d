"""Builders shared by the engine acceptance tests: HF oracles, token-id prompts, engines.

The oracle is HF ``transformers`` in float32 on the same generated checkpoint; tokens must match
exactly. Checkpoints come from the session-cached ``make_model_dir`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from xengine.api.messages import CompletionDelta
from xengine.engine import Engine
from xengine.llm import engine_config

ARCHS = ("qwen3", "qwen2", "llama", "gemma3", "qwen3_next", "nemotron_h", "mimo_v2_flash")
VOCAB_SIZE = 2048  # of the "tiny" checkpoints
FIRST_PLAIN_ID = 3  # ids 0..2 are the special tokens of the tiny tokenizer


class HFOracle:
    """HF greedy generation and logits on one checkpoint (float32, eager, batch of one)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos_token_ids = _as_list(self.model.generation_config.eos_token_id)

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True, **kw: Any) -> list[int]:
        """``generate(do_sample=False)``; with ``ignore_eos`` the model's eos ids are switched off."""
        gen_cfg = self.model.generation_config
        saved = gen_cfg.eos_token_id
        if ignore_eos:
            gen_cfg.eos_token_id = None
        try:
            out = self.model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, **kw
            )
        finally:
            gen_cfg.eos_token_id = saved
        return out[0, len(prompt) :].tolist()

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 [len, V] logits of one full forward over ``token_ids``."""
        return self.model(torch.tensor([token_ids])).logits[0].float()


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@pytest.fixture(scope="session")
def hf_oracle(make_model_dir: Callable[..., Path]) -> Callable[[str], HFOracle]:
    """Factory ``arch -> HFOracle`` on the tiny checkpoint of that arch (cached per session)."""
    cache: dict[str, HFOracle] = {}

    def _get(arch: str) -> HFOracle:
        if arch not in cache:
            cache[arch] = HFOracle(make_model_dir(arch))
        return cache[arch]

    return _get


def random_prompts(lengths: list[int], seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """Token-id prompts of the given lengths (plain ids only), each after ``prefix`` when given."""
    rng = random.Random(seed)
    head = list(prefix or [])
    return [head + [rng.randrange(FIRST_PLAIN_ID, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def make_engine(model_dir: Path, **kw: Any) -> Engine:
    """An ``Engine`` with the ``LLM`` keyword names (any engine config field: block_size, kv_layout, ...)."""
    return Engine(engine_config(str(model_dir), **kw))


def run_to_completion(engine: Engine, max_steps: int = 100_000) -> list[CompletionDelta]:
    """Step until the engine has nothing left; every delta, in order."""
    deltas: list[CompletionDelta] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        deltas.extend(engine.step())
    raise AssertionError(f"engine still busy after {max_steps} steps")


def assert_engine_idle(engine: Engine, free_blocks_at_start: int) -> None:
    """Nothing queued, running, tracked or holding KV; the pool is back where it started."""
    s = engine.scheduler
    assert not engine.has_unfinished_requests()
    assert s.waiting == [] and s.running == []
    assert s.seqs == {}, f"leaked sequences: {sorted(s.seqs)[:5]}"
    assert s.groups == {}, f"leaked request groups: {sorted(s.groups)[:5]}"
    assert s.updated == {}
    assert engine.kv.block_tables == {}, f"leaked block tables: {sorted(engine.kv.block_tables)[:5]}"
    assert engine.kv.num_free_blocks == free_blocks_at_start
    assert all(c == 0 for c in engine.kv.pool.ref_cnt)
    assert engine.runner.generators == {}
    xt = engine.get_stats().xtensor
    if xt is not None:  # every page free or reusable (mapped in a released slot); no slot in use
        assert xt.num_allocated == 0 and xt.num_mapped == 0, xt
        assert xt.num_free + xt.num_reusable == xt.num_pages
        assert engine.kv_setup.layout.slots.slot_of == {}
