"""Qwen3-Next (gated DeltaNet + gated attention + shared-expert MoE) against HF transformers in float32.

Logits through a hand-built forward context (paged KV for the attention layer, state slots for the
DeltaNet layers): a batch of prompts in one step, a prompt in two chunks with another sequence's
decodes beside it, greedy decode steps; max abs difference <= 1e-4 and the same argmax. Then the
config's refusals, the state shapes the engine allocates, and a check that the carried state matters
(so the parity above would catch a state dropped between chunks). Last, greedy tokens through
``LLM`` against HF ``generate``: chunked prefill, prefix-cache hits resumed from state snapshots, and
seeded sampling with ``n > 1`` the same with async scheduling on and off.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from graph.forward_context import forward_context
from ops.recurrent_metadata import RecurrentMetadata
from tests.xengine.conftest import random_prompts
from tests.xengine.models.helpers import PagedKV
from xengine.api.messages import SamplingParams
from xengine.llm import LLM
from xengine.models.loader import iterate_weights, load_model, safetensors_files
from xengine.models.qwen3_next import Qwen3NextForCausalLM
from xengine.models.qwen3_next_config import qwen3_next_config_from_hf

ATOL_FP32 = 1e-4
VOCAB = 2048
NUM_SLOTS = 8


@pytest.fixture(scope="module")
def model_dir(make_model_dir):
    return make_model_dir("qwen3_next")


@pytest.fixture(scope="module")
def ours(model_dir):
    return load_model(str(model_dir), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class Stepper:
    """Runs the model over hand-built steps: paged KV for attention layers, NaN-filled state slots for the
    DeltaNet layers (a read of a slot never written shows up as NaN); sequence ``i`` owns slot ``i``."""

    def __init__(self, model: Qwen3NextForCausalLM) -> None:
        cfg = model.config
        self.model = model
        self.kv = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, num_blocks=128)
        self.states: list[tuple[torch.Tensor, ...] | None] = [None] * cfg.num_layers
        for layer, shapes in model.recurrent_state_shapes().items():
            self.states[layer] = tuple(torch.full((NUM_SLOTS, *s), float("nan"), dtype=d) for s, d in shapes)

    @torch.no_grad()
    def step(
        self, chunks: list[tuple[int, list[int], int]], fresh: tuple[int, ...] = ()
    ) -> list[torch.Tensor]:
        """``chunks``: (seq id, new tokens, position of the first); a chunk at position 0 (or a sequence in
        ``fresh``) starts from a zero state. Returns each chunk's logits."""
        lens = [len(c[1]) for c in chunks]
        meta = self.kv.step([c[0] for c in chunks], lens, [c[2] + n for c, n in zip(chunks, lens)])
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        recurrent = RecurrentMetadata(
            query_start_loc=starts,
            slots=[c[0] for c in chunks],
            has_state=[c[2] > 0 and c[0] not in fresh for c in chunks],
        )
        ids = torch.tensor([t for c in chunks for t in c[1]])
        positions = torch.tensor([p for c in chunks for p in range(c[2], c[2] + len(c[1]))])
        with forward_context(meta, self.kv.caches, len(ids), recurrent=recurrent, states=self.states):
            logits = self.model.compute_logits(self.model.forward_tokens(ids, positions))
        return list(logits.split(lens))


def _tokens(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL_FP32, f"max abs logit diff {diff:.2e} > {ATOL_FP32}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_checkpoint_is_hybrid(model_dir, ours) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["linear_num_value_heads"] == 2 * config["linear_num_key_heads"]  # GQA in the DeltaNet
    assert ours.config.rotary_dim == config["head_dim"] // 4  # partial RoPE
    assert ours.config.sparse_layers == (False, True, True, True)  # mlp_only_layers=[0]


def test_recurrent_state_shapes(ours) -> None:
    cfg = ours.config
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + 4 * cfg.linear_value_head_dim
    expected = (
        ((conv_dim, cfg.linear_conv_kernel_dim - 1), torch.float32),
        ((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), torch.float32),
    )
    assert ours.recurrent_state_shapes() == {0: expected, 1: expected, 2: expected}


def test_batched_prefill_in_one_step_matches_hf(ours, hf) -> None:
    seqs = _tokens([5, 70, 131], seed=1)  # one, two and three delta-rule chunks of 64
    outs = Stepper(ours).step([(i, toks, 0) for i, toks in enumerate(seqs)])
    for toks, out in zip(seqs, outs):
        _assert_close(out, _hf_logits(hf, toks))


def test_two_chunks_beside_decodes_then_greedy_decode_matches_hf(ours, hf) -> None:
    long, short = _tokens([100, 9], seed=2)
    ref_long, ref_short = _hf_logits(hf, long), _hf_logits(hf, short)
    stepper = Stepper(ours)
    out_long, out_short = stepper.step([(0, long[:37], 0), (1, short[:8], 0)])
    _assert_close(out_long, ref_long[:37])
    _assert_close(out_short, ref_short[:8])
    # the second chunk continues from the carried states, beside the other sequence's decode
    out_short, out_long = stepper.step([(1, short[8:], 8), (0, long[37:], 37)])
    _assert_close(out_short, ref_short[8:])
    _assert_close(out_long, ref_long[37:])
    seqs, outs = [long, short], [out_long, out_short]
    for step in range(5):  # all-decode steps (one batch of T = 1), the batch order changing
        for i, out in enumerate(outs):
            seqs[i] = seqs[i] + [int(out[-1].argmax())]
        order = [1, 0] if step % 2 else [0, 1]
        step_outs = stepper.step([(i, seqs[i][-1:], len(seqs[i]) - 1) for i in order])
        outs = [step_outs[order.index(i)] for i in range(2)]
        for i, out in enumerate(outs):
            _assert_close(out[-1], _hf_logits(hf, seqs[i])[-1])


def test_the_carried_state_matters(ours, hf) -> None:
    """The second chunk from a zero state instead of the first chunk's: other logits, so the parity
    tests above see a state lost or misplaced between steps."""
    (toks,) = _tokens([60], seed=3)
    stepper = Stepper(ours)
    stepper.step([(0, toks[:30], 0)])
    out = stepper.step([(0, toks[30:], 30)], fresh=(0,))[0]
    assert (out - _hf_logits(hf, toks)[30:]).abs().max().item() > 100 * ATOL_FP32


def test_without_a_forward_context_the_mixer_runs_one_sequence(ours) -> None:
    """A DeltaNet layer called directly (warm-up, capture) runs all rows as one sequence from zeros."""
    layer = ours.model.layers[0].linear_attn
    x = torch.randn(12, ours.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = layer(torch.arange(12), x)
        first = layer(torch.arange(5), x[:5])
    assert whole.shape == x.shape and torch.isfinite(whole).all()
    torch.testing.assert_close(whole[:5], first, rtol=1e-5, atol=1e-5)  # causal: a prefix is unchanged


def test_bfloat16_loads_and_mostly_agrees(model_dir, hf) -> None:
    model = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"))
    shapes = model.recurrent_state_shapes()[0]
    assert shapes[0][1] == torch.bfloat16 and shapes[1][1] == torch.float32  # conv state: model dtype
    (toks,) = _tokens([40], seed=5)
    out = Stepper(model).step([(0, toks, 0)])[0]
    ref = _hf_logits(hf, toks)
    assert torch.isfinite(out).all()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_mtp_weights_are_skipped_and_unknown_ones_refused(model_dir) -> None:
    """Released checkpoints carry a multi-token-prediction head (``mtp.*``) that HF skips; so do we."""
    hf_config = json.loads((model_dir / "config.json").read_text())

    def load(extra: str) -> None:
        with torch.device("meta"):
            model = Qwen3NextForCausalLM.from_hf_config(hf_config)
        model.to_empty(device="cpu")
        weights = iterate_weights(safetensors_files(str(model_dir)))
        model.load_weights([*weights, (extra, torch.zeros(4, 4))])

    load("mtp.layers.0.mlp.gate.weight")
    with pytest.raises(ValueError, match="unexpected weight 'model.mtp.weight'"):
        load("model.mtp.weight")


def _hf_config(**changes) -> dict:
    base = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    }  # fmt: skip
    return {**base, **changes}


def test_config_defaults_follow_hf() -> None:
    """Keys a config.json may omit take HF's Qwen3-Next defaults: a full-attention layer every 4th,
    a quarter of each head rotated, renormalised top-k."""
    cfg = qwen3_next_config_from_hf(_hf_config())
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rotary_dim == 4 and cfg.norm_topk_prob
    assert cfg.linear_layers == [0, 1, 2]
    cfg = qwen3_next_config_from_hf(_hf_config(full_attention_interval=2, mlp_only_layers=[1]))
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.sparse_layers == (True, False, True, True)


@pytest.mark.parametrize(
    "changes,key",
    [
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_key_head_dim": 0}, "linear_key_head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_config_refuses_what_it_does_not_run(changes: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        qwen3_next_config_from_hf(_hf_config(**changes))


MAX_TOKENS = 12
SNAPSHOT_INTERVAL = 32


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 40, 70, 130], seed=21)


@pytest.fixture(scope="module")
def expected(model_dir, hf_oracle, prompts):
    oracle = hf_oracle("qwen3_next")
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    "kw",
    [dict(max_num_batched_tokens=16), dict(max_num_batched_tokens=48, async_scheduling="on")],
    ids=["chunk16", "chunk48+async"],
)
def test_greedy_matches_hf_through_the_engine(model_dir, prompts, expected, kw) -> None:
    """Prompts past a delta-rule chunk (64) in prefill chunks of 16 / 48, twice: the second run resumes
    from the snapshots the first left (the last snapshot before each prompt's end) and must not change
    a token."""
    llm = LLM(str(model_dir), block_size=16, state_snapshot_interval=SNAPSHOT_INTERVAL, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.outputs[0].token_ids == ref, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
    hits = [out.num_cached_tokens for out in outs]
    assert hits == [(len(p) - 1) // SNAPSHOT_INTERVAL * SNAPSHOT_INTERVAL for p in prompts]
    assert llm.engine.get_stats().state_pool.num_snapshot_hits == 3


def test_seeded_n_is_the_same_with_async_on_and_off(model_dir, prompts) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=11, max_tokens=8, ignore_eos=True)
    runs = []
    for kw in (dict(async_scheduling="off"), dict(async_scheduling="on", max_num_batched_tokens=16)):
        llm = LLM(str(model_dir), block_size=16, **kw)
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
    assert runs[0] == runs[1]
    assert any(len({tuple(t) for t in seqs}) > 1 for seqs in runs[0])  # the n samples differ
