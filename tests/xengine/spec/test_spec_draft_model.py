"""The ``draft_model`` proposer: a second checkpoint with the target's vocabulary drafts greedily, with
a runner and a KV pool of its own. Greedy tokens equal HF's plain greedy on the target whatever the
draft: the target itself (every draft accepted), a noisy copy of it (some accepted, some not: the draft
KV is rewound to the first differing token and computed again), an unrelated model (all rejected);
under prefix caching, chunked prefill and preemption. Sampling stays seeded-reproducible with ``n > 1``;
every sequence's draft state is released; a draft with another vocabulary or no folder is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.xengine.conftest import assert_engine_idle, make_engine
from tests.xengine.test_engine_parity import CONFIGS, make_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def noisy_qwen3(make_model_dir, tmp_path_factory) -> Path:
    """The tiny qwen3 with gaussian noise on every weight matrix: it mostly agrees with the original."""
    out = tmp_path_factory.mktemp("noisy-qwen3")
    for f in make_model_dir("qwen3").iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if w.dim() == 2:
            weights[name] = w + torch.randn(w.shape, generator=gen) * w.std() * 0.03
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def expected(hf_oracle) -> tuple[list[list[int]], list[list[int]]]:
    prompts = make_prompts(seed=7)[:12]
    oracle = hf_oracle("qwen3")
    return prompts, [oracle.greedy(p, MAX_TOKENS) for p in prompts]


def _spec(draft: Path, k: int = 4) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


CASES = [
    ("self", "prefix+chunked"),
    ("noisy", "prefix+chunked"),
    ("noisy", "noprefix+whole"),
    ("noisy", "preempt"),
    ("llama", "prefix+chunked"),
]


SLOW = {("noisy", "prefix+chunked"), ("noisy", "noprefix+whole")}  # the default run: one per draft kind
PARAMS = [pytest.param(*c, id="-".join(c), marks=pytest.mark.slow if c in SLOW else ()) for c in CASES]


@pytest.mark.parametrize(("draft", "config"), PARAMS)
def test_greedy_tokens_match_hf(make_model_dir, noisy_qwen3, expected, draft, config) -> None:
    prompts, want = expected
    draft_dir = {"self": make_model_dir("qwen3"), "noisy": noisy_qwen3, "llama": make_model_dir("llama")}[
        draft
    ]
    kw = dict(CONFIGS[config])
    llm = LLM(
        str(make_model_dir("qwen3")),
        block_size=16,
        max_num_seqs=16,
        speculative_config=_spec(draft_dir),
        **kw,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, w) in enumerate(zip(outputs, want)):
            assert list(out.outputs[0].token_ids) == w, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    drafter = llm.engine.scheduler.drafter
    stats = drafter.stats
    assert stats.num_draft_tokens > 0
    if draft == "self":
        assert stats.acceptance_rate == 1.0
    elif draft == "noisy":
        assert 0.1 < stats.acceptance_rate < 0.95, stats
    if "num_blocks" in kw:
        assert llm.engine.get_stats().num_preemptions > 0
    proposer = drafter.proposer
    assert proposer.shadows == {} and proposer.kv.block_tables == {}  # every draft state released


def test_seeded_sampling_with_forks_is_reproducible(make_model_dir, noisy_qwen3) -> None:
    llm = LLM(str(make_model_dir("qwen3")), block_size=16, speculative_config=_spec(noisy_qwen3, 3))
    free = llm.engine.kv.num_free_blocks
    prompts = make_prompts(seed=9)[:4]
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=24, seed=5, ignore_eos=True, n=2)
    first = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again and all(len(c) == 24 for o in first for c in o)
    assert llm.engine.scheduler.drafter.stats.num_accepted_tokens > 0
    assert_engine_idle(llm.engine, free)


def test_a_draft_of_another_vocabulary_or_no_folder_is_refused(make_model_dir, tmp_path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(make_model_dir("llama"), other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 4096
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary of 4096 ids"):
        make_engine(make_model_dir("qwen3"), speculative_config=_spec(other))
    with pytest.raises(ValueError, match="not a folder"):
        make_engine(make_model_dir("qwen3"), speculative_config=_spec(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs speculative_config.model"):
        make_engine(
            make_model_dir("qwen3"), speculative_config={"method": "draft_model", "num_speculative_tokens": 2}
        )
