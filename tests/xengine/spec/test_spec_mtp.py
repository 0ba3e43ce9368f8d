"""The ``mtp`` proposer: the checkpoint's own multi-token-prediction layer drafts from the target's hidden
states (``xengine/spec/mtp.py``).

DeepSeek-V3 (61 dense layers and one MoE MTP layer, the checkpoint HF runs MTP on): greedy tokens equal
HF's plain greedy and HF's ``generate(use_mtp=True)``; each of our first drafts equals the draft HF's own
MTP layer makes in the same state. Random MTP layers rarely draft right, so an "oracle" proposer also
decides what is verified (a known continuation, about a third corrupted: full and partial accepts and
rejections) while the MTP layer runs beside it: every draft it made, in every state the sequence
passed through, equals a from-scratch HF computation (the target over the whole sequence, then the MTP
layer chained ``k`` times) -- so its KV and the hidden rows it read stayed right across accepts,
rejections, chunked prefill, prefix-cache hits (its own cached blocks), async scheduling and
preemption. Qwen3-Next and MiMo-V2-Flash (HF has no MTP for them): greedy tokens equal our engine's
without speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.xengine.conftest import assert_engine_idle, random_prompts
from tests.xengine.spec.oracle import RecordingProposer, run_with_oracle
from xengine.api.messages import SamplingParams
from xengine.llm import LLM
from xengine.tools.mtp_checkpoint import add_mtp_layer, make_deepseek_with_mtp

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CONFIGS: dict[str, dict[str, Any]] = {
    "prefix+chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=32),
    "async": dict(async_scheduling=True, enable_prefix_caching=True),
    "preempt": dict(enable_prefix_caching=True, max_num_batched_tokens=32, num_blocks=14),
}


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory) -> Path:
    return make_deepseek_with_mtp(tmp_path_factory.mktemp("deepseek61-mtp"))


@pytest.fixture(scope="module")
def with_mtp(make_model_dir, tmp_path_factory):
    cache: dict[tuple[str, int], Path] = {}

    def _get(arch: str, layers: int = 1) -> Path:
        if (arch, layers) not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-mtp{layers}")
            cache[arch, layers] = add_mtp_layer(make_model_dir(arch), out, num_layers=layers)
        return cache[arch, layers]

    return _get


@pytest.fixture(scope="module")
def hf(deepseek_mtp):
    """HF's DeepSeek-V3 and its MTP model (``transformers.modeling_layers.MtpModel``)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    model = AutoModelForCausalLM.from_pretrained(deepseek_mtp, dtype=torch.float32).eval()
    return model, MtpModel.from_pretrained(model).eval()


def _prompts() -> list[list[int]]:
    prompts = random_prompts([5, 18, 40], seed=31)
    return prompts + [prompts[2][:35] + p for p in random_prompts([4, 12], seed=32)]  # shared prefixes


@pytest.fixture(scope="module")
def deepseek_mtp2(tmp_path_factory) -> Path:
    return make_deepseek_with_mtp(tmp_path_factory.mktemp("deepseek61-mtp2"), num_mtp_layers=2)


@pytest.fixture(scope="module")
def hf2(deepseek_mtp2):
    """HF's DeepSeek-V3 and its ``MtpModel`` of two chained layers (HF finds MTP weights by the model's
    ``_keys_to_ignore_on_load_unexpected`` patterns, which name ``model.layers.61`` only: the second
    layer's pattern is added)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    model = AutoModelForCausalLM.from_pretrained(deepseek_mtp2, dtype=torch.float32).eval()
    model._keys_to_ignore_on_load_unexpected = [r"model\.layers\.61.*", r"model\.layers\.62.*"]
    return model, MtpModel.from_pretrained(model).eval()


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """HF's plain greedy continuation of each prompt (``MAX_TOKENS`` tokens)."""
    return [
        model.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )[0, len(p) :].tolist()
        for p in prompts
    ]


@torch.no_grad()
def _hf_drafts(hf, tokens: list[int], k: int) -> list[int]:
    """HF's MTP drafts for ``tokens`` from scratch: the target's final hidden states over all of them,
    then the MTP layers as ``MtpModel.forward`` chains them -- layer ``i`` over the pairs (layer
    ``i - 1``'s output at t, the token at t + i + 1, the drafts so far past the known ones) -- and past
    the layers, the last one again one position on."""
    model, mtp = hf
    ids = torch.tensor([tokens])
    hidden = model(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
    inputs, drafts = ids[:, 1:], []
    positions = torch.arange(1, inputs.shape[1] + 1)[None]
    for depth in range(k):
        layer = min(depth, len(mtp.layers) - 1)
        out = mtp.forward_layer(layer, hidden, positions, None, input_ids=inputs)
        token = torch.tensor([[int(mtp._project_to_logits(out[:, -1]).argmax(-1))]])
        drafts.append(int(token))
        if depth + 1 < len(mtp.layers):  # the next layer: the same positions, the tokens one on
            inputs, positions, hidden = torch.cat([inputs[:, 1:], token], 1), positions + 1, out
        else:  # the last layer again, one position on
            inputs = torch.cat([inputs, token], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
    return drafts


def test_deepseek_greedy_and_drafts_equal_hf_mtp(deepseek_mtp, hf) -> None:
    model, _ = hf
    prompts = _prompts()[:3]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        plain = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        mtp = model.generate(
            ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, use_mtp=True
        )
        assert torch.equal(plain, mtp)
        expected.append(plain[0, len(p) :].tolist())
    llm = LLM(
        str(deepseek_mtp), block_size=16, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
    )
    drafter = llm.engine.scheduler.drafter
    drafter.proposer = rec = RecordingProposer(drafter.proposer)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert len(rec.seen) >= 3 * (MAX_TOKENS - 2)
    for tokens, drafts in list(rec.seen.items())[::4]:
        assert drafts == _hf_drafts(hf, list(tokens), 1), f"{len(tokens)} tokens"
    assert drafter.stats.num_draft_tokens > 0


# the default run keeps preemption (prefix caching and chunked prefill with it) and async; the rest slow
STATE_CONFIGS = [pytest.param(c, marks=pytest.mark.slow if c == "prefix+chunked" else ()) for c in CONFIGS]


@pytest.mark.parametrize("config", STATE_CONFIGS)
def test_mtp_state_stays_right_across_accepts_and_rejections(deepseek_mtp, hf, config) -> None:
    prompts = _prompts()
    expected = _hf_greedy(hf[0], prompts)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = LLM(str(deepseek_mtp), block_size=16, speculative_config=spec, **CONFIGS[config])
    engine = llm.engine
    free = engine.kv.num_free_blocks
    rec = run_with_oracle(llm, prompts, expected, GREEDY)
    states = list(rec.seen.items())
    assert len(states) > 20
    for tokens, drafts in states[:: max(len(states) // 12, 1)]:
        assert drafts == _hf_drafts(hf, list(tokens), len(drafts)), f"{len(tokens)} tokens"
    assert_engine_idle(engine, free)
    mtp = rec.inner
    assert mtp.shadows == {} and mtp.kv.block_tables == {} and mtp.hidden.available("0") is None


@pytest.mark.parametrize(
    ("arch", "k", "layers"),
    [
        pytest.param("qwen3_next", 1, 1, marks=pytest.mark.slow),
        ("qwen3_next", 3, 2),
        ("mimo_v2_flash", 4, 3),
    ],
)
def test_greedy_equals_the_engine_without_speculation(make_model_dir, with_mtp, arch, k, layers) -> None:
    """Qwen3-Next (recurrent layers; two MTP layers sharing its ``fc`` and norms) and MiMo-V2-Flash (three
    chained MTP layers as it ships, sliding-window ones with sinks, shorter than the prompts; ``k`` past
    them), which HF does not run MTP on."""
    prompts = _prompts()
    plain = LLM(str(make_model_dir(arch)), block_size=16)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    spec = {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(
        str(with_mtp(arch, layers)), block_size=16, speculative_config=spec, **CONFIGS["prefix+chunked"]
    )
    for run in range(2):
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected, f"run {run}"
    stats = llm.engine.scheduler.drafter.stats
    assert stats.num_draft_tokens > 0 and len(stats.proposed_per_pos) == k
    assert len(llm.engine.scheduler.drafter.proposer.caches) == layers  # KV of every layer


@pytest.mark.parametrize("config", [pytest.param("async", marks=pytest.mark.slow), "preempt"])
def test_chained_mtp_layers_draft_as_hf_chains_them(deepseek_mtp2, hf2, config) -> None:
    """Two MTP layers and ``k = 3`` (the last layer once more): every draft made while an oracle drives
    accepts and rejections (so the second layer's KV at the last positions, computed from drafts, is
    recomputed from the tokens kept) and prefix-cache hits equals HF's from-scratch chain."""
    prompts = _prompts()
    expected = _hf_greedy(hf2[0], prompts)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = LLM(str(deepseek_mtp2), block_size=16, speculative_config=spec, **CONFIGS[config])
    free = llm.engine.kv.num_free_blocks
    rec = run_with_oracle(llm, prompts, expected, GREEDY)
    states = list(rec.seen.items())
    assert len(states) > 20 and len(rec.inner.caches) == 2
    for tokens, drafts in states[:: max(len(states) // 12, 1)]:
        assert drafts == _hf_drafts(hf2, list(tokens), len(drafts)), f"{len(tokens)} tokens"
    assert_engine_idle(llm.engine, free)


def test_mtp_without_mtp_layers_is_refused(make_model_dir) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="multi-token-prediction"):
        LLM(str(make_model_dir("qwen3")), speculative_config=spec)
    with pytest.raises(ValueError, match="declares none"):
        LLM(str(make_model_dir("deepseek_v3")), speculative_config=spec)
