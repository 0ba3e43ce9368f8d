"""The ``eagle`` and ``eagle3`` proposers: an EAGLE head from a folder of its own drafts from the target's
hidden states (``xengine/models/eagle.py``, ``xengine/spec/head_proposer.py``).

HF has no EAGLE, so the heads' drafts are checked against a from-scratch reference built from HF's Llama
attention and MLP modules over the head's checkpoint tensors: the target (HF) over the whole sequence,
its final hidden state (EAGLE-1) or the residual stream entering three of its layers (EAGLE-3), then the
head over every pair, chained ``k`` times. Random heads rarely draft right, so an "oracle" proposer decides
what is verified (a known continuation, a third of it corrupted: full and partial accepts, rejections)
while the head runs beside it; every draft it made, in every state, equals the reference -- through
chunked prefill, prefix-cache hits, async scheduling and preemption. Greedy tokens equal the target's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.xengine.conftest import assert_engine_idle, random_prompts
from tests.xengine.spec.oracle import run_with_oracle
from xengine.api.messages import SamplingParams
from xengine.llm import LLM
from xengine.tools.eagle_checkpoint import make_eagle_head

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
AUX = [0, 2, 3]  # of the tiny qwen3's four layers
CONFIGS: dict[str, dict[str, Any]] = {
    "prefix+chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=32),
    "async": dict(async_scheduling=True, enable_prefix_caching=True),
    "preempt": dict(enable_prefix_caching=True, max_num_batched_tokens=32, num_blocks=14),
}


@pytest.fixture(scope="module")
def heads(make_model_dir, tmp_path_factory) -> dict[str, Path]:
    target = make_model_dir("qwen3")
    return {
        m: make_eagle_head(target, tmp_path_factory.mktemp(f"head-{m}"), m, aux_layers=AUX)
        for m in ("eagle", "eagle3")
    }


class _Reference:
    """The EAGLE head of ``folder`` computed from scratch with HF's Llama modules."""

    def __init__(self, target_dir: Path, folder: Path, method: str) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.method = method
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        hf = json.loads((folder / "config.json").read_text())
        cfg = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "eagle_config")})
        cfg._attn_implementation = "eager"
        size = cfg.hidden_size
        w = {
            k.removeprefix("midlayer.").removeprefix("layers.0."): v
            for k, v in load_file(folder / "model.safetensors").items()
        }
        self.layer = LlamaDecoderLayer(cfg, 0).eval()
        if method == "eagle3":
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(self.layer.self_attn, name)
                setattr(self.layer.self_attn, name, torch.nn.Linear(2 * size, proj.out_features, bias=False))
        own = {k: v for k, v in w.items() if k in dict(self.layer.named_parameters())}
        self.layer.load_state_dict(own, strict=False)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.w = w
        self.eps = cfg.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pos = torch.arange(n)[None]
        return self.layer.self_attn(x, self.rotary(x, pos), mask)[0]

    def _head(
        self, embeds: torch.Tensor, hidden: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer, w = self.layer, self.w
        if self.method == "eagle":
            x = torch.cat([embeds, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
            attn = self._attn(x)
            residual = x + attn
            out = layer.mlp(self._norm(residual, "post_attention_layernorm.weight")) + residual
            return out, out
        if depth == 0:
            hidden = hidden @ w["fc.weight"].T
        x = torch.cat(
            [self._norm(embeds, "input_layernorm.weight"), self._norm(hidden, "hidden_norm.weight")], -1
        )
        residual = hidden + self._attn(x)
        prenorm = layer.mlp(self._norm(residual, "post_attention_layernorm.weight")) + residual
        return self._norm(prenorm, "norm.weight"), prenorm

    def _logits_token(self, hidden: torch.Tensor) -> int:
        if self.method == "eagle":
            return int(self.target.lm_head(hidden).argmax())
        index = int((hidden @ self.w["lm_head.weight"].T).argmax())
        return index + int(self.w["d2t"][index])

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor([tokens])
        states = self.target(ids, output_hidden_states=True).hidden_states
        hidden = states[-1] if self.method == "eagle" else torch.cat([states[i] for i in AUX], -1)
        hidden, inputs, out = hidden[:, :-1], ids[:, 1:], []
        for depth in range(k):
            embeds = self.target.model.embed_tokens(inputs)
            logit_hidden, chain = self._head(embeds, hidden, depth)
            out.append(self._logits_token(logit_hidden[0, -1]))
            inputs = torch.cat([inputs, torch.tensor([[out[-1]]])], 1)
            if depth == 0 and self.method == "eagle3":  # later steps read the head's own width
                hidden = torch.cat([hidden @ self.w["fc.weight"].T, chain[:, -1:]], 1)
            else:
                hidden = torch.cat([hidden, chain[:, -1:]], 1)
        return out


def _prompts() -> list[list[int]]:
    prompts = random_prompts([5, 18, 40], seed=41)
    return prompts + [prompts[2][:35] + p for p in random_prompts([4, 12], seed=42)]


METHOD_CONFIGS = [
    ("eagle", "prefix+chunked"),
    ("eagle3", "async"),
    ("eagle3", "preempt"),
    ("eagle", "preempt"),
]


@pytest.mark.parametrize(("method", "config"), METHOD_CONFIGS)
def test_head_drafts_equal_the_reference_across_accepts_and_rejections(
    make_model_dir, heads, method, config
) -> None:
    target = make_model_dir("qwen3")
    prompts = _prompts()
    expected = [
        list(o.outputs[0].token_ids)
        for o in LLM(str(target), block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    ]
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(heads[method])}
    llm = LLM(str(target), block_size=16, speculative_config=spec, **CONFIGS[config])
    engine = llm.engine
    free = engine.kv.num_free_blocks
    rec = run_with_oracle(llm, prompts, expected, GREEDY)
    reference = _Reference(target, heads[method], method)
    states = list(rec.seen.items())
    assert len(states) > 20
    for tokens, drafts in states[:: max(len(states) // 10, 1)]:
        assert drafts == reference.drafts(list(tokens), len(drafts)), f"{len(tokens)} tokens"
    assert_engine_idle(engine, free)
    assert rec.inner.shadows == {} and rec.inner.kv.block_tables == {}


def test_heads_that_do_not_fit_the_target_are_refused(make_model_dir, heads, tmp_path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(heads["eagle3"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    spec = {"method": "eagle3", "num_speculative_tokens": 2, "model": str(other)}
    with pytest.raises(ValueError, match="vocabulary of .* the target"):
        LLM(str(make_model_dir("qwen3")), speculative_config=spec)
    with pytest.raises(ValueError, match="is not a folder"):
        LLM(str(make_model_dir("qwen3")), speculative_config={**spec, "model": "/no/such/head"})
    with pytest.raises(ValueError, match="needs speculative_config.model"):
        LLM(str(make_model_dir("qwen3")), speculative_config={"method": "eagle", "num_speculative_tokens": 2})


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mimo_v2_flash"])
def test_an_eagle_head_on_other_targets_keeps_their_greedy_tokens(make_model_dir, tmp_path, arch) -> None:
    """EAGLE-1 over Llama, Gemma 3 (sliding windows, scaled embeddings) and MiMo-V2-Flash (hybrid pools)
    targets: greedy tokens equal the target's without speculation, and the head drafted. EAGLE-3 on
    Gemma 3, whose layers are not captured, is refused rather than left idle."""
    target = make_model_dir(arch)
    head = make_eagle_head(target, tmp_path / "head", "eagle")
    prompts = _prompts()
    plain = LLM(str(target), block_size=16)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    spec = {"method": "eagle", "num_speculative_tokens": 2, "model": str(head)}
    llm = LLM(str(target), block_size=16, speculative_config=spec, enable_prefix_caching=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert llm.engine.scheduler.drafter.stats.num_draft_tokens > 0
    if arch == "gemma3":
        eagle3 = make_eagle_head(target, tmp_path / "head3", "eagle3")
        with pytest.raises(ValueError, match="eagle3 reads the target's layers"):
            LLM(str(target), speculative_config={**spec, "method": "eagle3", "model": str(eagle3)})
