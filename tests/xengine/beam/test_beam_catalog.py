"""Catalog-constrained beam search (generative recommendation): only catalog items come out, and
with beam_width >= the number of distinct prefixes at every level the result is exact: equal to
scoring every catalog item by teacher forcing (sum of its tokens' logprobs) and sorting."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.xengine.conftest import random_prompts
from xengine.beam.catalog import ItemCatalog
from xengine.llm import LLM, BeamSearchParams

ITEM_LEN = 3


def make_catalog(num_items: int, seed: int, num_first: int = 6) -> list[list[int]]:
    """Items sharing first tokens (a real trie, not a flat list)."""
    rng = random.Random(seed)
    firsts = rng.sample(range(3, 2048), num_first)
    items: set[tuple[int, ...]] = set()
    while len(items) < num_items:
        items.add((rng.choice(firsts), rng.randrange(3, 2048), rng.randrange(3, 2048)))
    return [list(i) for i in sorted(items)]


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> LLM:
    return LLM(str(tiny_qwen3), num_threads=1, block_size=4, num_blocks=512, max_model_len=128)


def brute_force(model: Any, prompt: list[int], items: list[list[int]]) -> list[tuple[float, list[int]]]:
    """Every item's sum of logprobs given the prompt (HF, teacher forcing), best first."""
    batch = torch.tensor([prompt + item for item in items])
    with torch.no_grad():
        logprobs = model(batch).logits.float().log_softmax(-1)
    scored = []
    for row, item in enumerate(items):
        pos = range(len(prompt) - 1, len(prompt) - 1 + len(item))
        scored.append((sum(logprobs[row, p, t].item() for p, t in zip(pos, item)), item))
    scored.sort(key=lambda s: -s[0])
    return scored


def test_trie_allowed_tokens_and_validation() -> None:
    cat = ItemCatalog("c", [[5, 6, 7], [5, 6, 8], [9, 1, 2], [5, 6, 7]], vocab_size=16)
    assert cat.num_items == 3 and cat.item_len == 3
    assert cat.allowed_token_ids([]).tolist() == [5, 9]
    assert cat.allowed_token_ids([5, 6]).tolist() == [7, 8]
    assert cat.allowed_token_ids([5, 9]).tolist() == []
    assert cat.contains([9, 1, 2]) and not cat.contains([9, 1])
    for bad, field in [([[1, 2], [1, 2, 3]], "items"), ([[1, 99]], "items"), ([], "items")]:
        with pytest.raises(ValueError, match=f"'{field}'"):
            ItemCatalog("c", bad, vocab_size=16)
    with pytest.raises(ValueError, match="'name'"):
        ItemCatalog("bad name!", [[1]], vocab_size=16)


@pytest.mark.parametrize("seed", [0, 1])
def test_constrained_beam_equals_brute_force(llm: LLM, hf_oracle: Callable[[str], Any], seed: int) -> None:
    items = make_catalog(24, seed)
    llm.register_catalog(f"small{seed}", items)
    prompt = random_prompts([10], seed=seed + 20)[0]
    num_items = 10
    # 24 items: at most 24 distinct prefixes per level, so width 24 and top_k 24 make the search exact
    params = BeamSearchParams(
        beam_width=24,
        beam_top_k=24,
        max_tokens=ITEM_LEN,
        num_return_sequences=num_items,
        length_penalty=0.0,
        catalog=f"small{seed}",
    )
    out = llm.beam_search(prompt, params, use_tqdm=False)[0].outputs
    want = brute_force(hf_oracle("qwen3").model, prompt, items)[:num_items]
    assert [o.token_ids for o in out] == [w[1] for w in want]
    assert [o.score for o in out] == pytest.approx([w[0] for w in want], abs=1e-4)
    assert llm.engine.kv.pool.ref_cnt == [0] * llm.engine.kv.pool.num_blocks


def test_narrow_beam_outputs_only_catalog_items(llm: LLM) -> None:
    items = make_catalog(300, seed=7, num_first=40)
    llm.register_catalog("wide", items)
    valid = {tuple(i) for i in items}
    for prompt in random_prompts([5, 9, 14], seed=3):
        params = BeamSearchParams(
            beam_width=4, beam_top_k=2, max_tokens=ITEM_LEN, length_penalty=0.0, catalog="wide"
        )
        out = llm.beam_search(prompt, params, use_tqdm=False)[0].outputs
        assert len(out) == 4
        assert all(tuple(o.token_ids) in valid for o in out)
        scores = [o.score for o in out]
        assert scores == sorted(scores, reverse=True)


def test_unknown_catalog_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="'catalog'"):
        llm.beam_search([5, 6], BeamSearchParams(beam_width=2, catalog="nope"), use_tqdm=False)
