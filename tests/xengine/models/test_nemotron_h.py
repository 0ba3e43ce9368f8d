"""Nemotron-H (Mamba2 + attention without RoPE + squared-ReLU MLP + MoE blocks) against HF
``transformers`` on the tiny checkpoint (pattern ``M-M*-E``).

First through hand-built forward contexts (paged KV for the attention layer, state slots for the Mamba2
layers): logits within 1e-4 of HF float32 for a prompt in one step, in two chunks and then decode steps,
and sequences batched in mixed steps. Then through the whole engine (``LLM``): greedy tokens equal to
HF's with chunked prefill and a warm prefix cache, and seeded ``n > 1`` sampling alike with async
scheduling on and off. Also: the config refusals, the older config keys, and both checkpoint layouts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ops.recurrent_metadata import RecurrentMetadata
from tests.xengine.conftest import random_prompts
from tests.xengine.models.helpers import PagedKV
from xengine.api.messages import SamplingParams
from xengine.llm import LLM
from xengine.models.info import read_model_info
from xengine.models.loader import load_model
from xengine.models.nemotron_h_config import nemotron_h_config_from_hf

ARCH = "nemotron_h"
ATOL = 1e-4
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(make_model_dir) -> Path:
    return make_model_dir(ARCH)


@pytest.fixture(scope="module")
def oracle(hf_oracle):
    return hf_oracle(ARCH)


@pytest.fixture(scope="module")
def ours(model_dir):
    return load_model(str(model_dir), torch.float32, torch.device("cpu"))


class Stepper:
    """Drives the model step by step as the runner would: attention KV in ``PagedKV``, each sequence's
    Mamba2 states in slot ``seq_id`` of NaN-filled state tensors (a fresh sequence must not read them)."""

    def __init__(self, model, num_slots: int = 4) -> None:
        cfg = model.config
        self.model = model
        self.kv = PagedKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        shapes = model.recurrent_state_shapes()
        self.states = [
            tuple(torch.full((num_slots, *shape), float("nan"), dtype=dtype) for shape, dtype in shapes[i])
            if i in shapes
            else None
            for i in range(cfg.num_layers)
        ]
        self.done: dict[int, int] = {}  # seq_id -> tokens computed

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One step where sequence ``seq_id`` adds ``tokens``, for each ``(seq_id, tokens)``; logits per chunk."""
        ids = [s for s, _ in chunks]
        starts = [self.done.get(s, 0) for s in ids]
        lens = [len(t) for _, t in chunks]
        meta = self.kv.step(ids, lens, [p + n for p, n in zip(starts, lens)])
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        recurrent = RecurrentMetadata(query_start_loc=qsl, slots=ids, has_state=[p > 0 for p in starts])
        input_ids = torch.tensor([t for _, toks in chunks for t in toks])
        positions = torch.tensor([p + i for p, n in zip(starts, lens) for i in range(n)])
        hidden = self.model(
            input_ids, positions, self.kv.caches, meta, recurrent=recurrent, states=self.states
        )
        for s, p, n in zip(ids, starts, lens):
            self.done[s] = p + n
        return list(self.model.compute_logits(hidden).split(lens))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs logit diff {diff:.2e} > {ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# ---------------------------------------------------------------------------- the checkpoint


def test_checkpoint_has_every_block_kind_and_random_constants(model_dir, ours) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    kinds = config["layers_block_type"]
    assert {"linear_attention", "full_attention", "mlp", "moe"} <= set(kinds)
    mixer = ours.model.layers[0].mixer
    for param in (mixer.A_log, mixer.D, mixer.dt_bias, mixer.norm.weight, ours.model.norm_f.weight):
        assert param.std() > 0.05  # HF's constants (ones, log(1..H)) would let a misuse pass


def test_model_info_reads_the_layer_count_and_kv_shape(model_dir, ours) -> None:
    """transformers writes Nemotron-H's config without ``num_hidden_layers`` (the layer list says it)."""
    info = read_model_info(str(model_dir))
    assert info.num_layers == ours.config.num_layers == 6
    assert (info.num_kv_heads, info.head_dim) == (ours.config.num_kv_heads, ours.config.head_dim)


# ---------------------------------------------------------------------------- hand-built steps


def test_one_prompt_in_one_step_matches_hf(ours, oracle) -> None:
    prompt = random_prompts([70], seed=1)[0]
    (logits,) = Stepper(ours).step([(0, prompt)])
    _assert_close(logits, oracle.logits(prompt))


def test_two_chunks_then_decodes_match_hf(ours, oracle) -> None:
    """A cut inside an SSD chunk and inside the conv window, then one token per step."""
    tokens = random_prompts([73], seed=2)[0]
    ref = oracle.logits(tokens)
    stepper = Stepper(ours)
    (first,) = stepper.step([(1, tokens[:37])])
    (second,) = stepper.step([(1, tokens[37:70])])
    _assert_close(torch.cat([first, second]), ref[:70])
    for pos in range(70, 73):
        (logits,) = stepper.step([(1, tokens[pos : pos + 1])])
        _assert_close(logits, ref[pos : pos + 1])


def test_sequences_batched_in_mixed_steps_match_hf(ours, oracle) -> None:
    """Prefill chunks beside one-token steps of other sequences (a one-token prompt among them), then
    an all-decode step of three sequences run as one batch, each from its own slot."""
    a, b, c = random_prompts([42, 66, 4], seed=3)
    refs = [oracle.logits(t) for t in (a, b, c)]
    stepper = Stepper(ours)
    out = stepper.step([(0, a[:39]), (2, b[:20]), (3, c[:1])])
    for got, ref in zip(out, (refs[0][:39], refs[1][:20], refs[2][:1])):
        _assert_close(got, ref)
    out = stepper.step([(0, a[39:40]), (2, b[20:65]), (3, c[1:3])])
    for got, ref in zip(out, (refs[0][39:40], refs[1][20:65], refs[2][1:3])):
        _assert_close(got, ref)
    out = stepper.step([(0, a[40:41]), (2, b[65:]), (3, c[3:])])
    for got, ref in zip(out, (refs[0][40:41], refs[1][65:], refs[2][3:])):
        _assert_close(got, ref)
    (last,) = stepper.step([(0, a[41:])])
    _assert_close(last, refs[0][41:])


def test_time_step_limit_clamps_the_step_as_hf_does(model_dir, make_config_variant, oracle) -> None:
    """A lower bound above some heads' steps: HF clamps its chunked path at ``time_step_min``, so with
    both set alike a one-step prefill must agree; and the clamp must change the output."""
    variant = make_config_variant(
        "dt-limit", {"time_step_limit": [0.3, 1e9], "time_step_min": 0.3}, arch=ARCH
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
    clamped = load_model(str(variant), torch.float32, torch.device("cpu"))
    prompt = random_prompts([50], seed=4)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    (logits,) = Stepper(clamped).step([(0, prompt)])
    _assert_close(logits, ref)
    assert (ref - oracle.logits(prompt)).abs().max() > 1e-2


# ---------------------------------------------------------------------------- config and loading


def _hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize(
    "key,value",
    [
        ("mamba_hidden_act", "gelu"),
        ("mlp_hidden_act", "silu"),
        ("sliding_window", 64),
        ("attention_bias", True),
        ("residual_in_fp32", True),
        ("time_step_limit", [0.5, 0.1]),
        ("layers_block_type", ["linear_attention", "sliding_attention"]),
        ("n_groups", 3),
    ],
)
def test_config_refuses_what_is_not_implemented(model_dir, key: str, value) -> None:
    with pytest.raises(ValueError, match=key):
        nemotron_h_config_from_hf({**_hf_config(model_dir), key: value})


def test_older_config_keys_parse_alike(model_dir) -> None:
    """NVIDIA's configs: ``hybrid_override_pattern``, ``mamba_``-prefixed names, ``attention_head_dim``."""
    hf = _hf_config(model_dir)
    renames = {
        "n_groups": "mamba_n_groups",
        "conv_kernel": "mamba_d_conv",
        "chunk_size": "mamba_chunk_size",
        "use_conv_bias": "mamba_conv_bias",
        "time_step_limit": "mamba_dt_limit",
        "head_dim": "attention_head_dim",
    }
    old = {renames.get(k, k): v for k, v in hf.items() if k != "layers_block_type"}
    old["hybrid_override_pattern"] = "M-M*-E"
    assert nemotron_h_config_from_hf(old) == nemotron_h_config_from_hf(hf)


def test_model_named_checkpoint_with_stacked_experts_loads_alike(model_dir, ours, tmp_path) -> None:
    """``model.*`` names and stacked ``experts.up_proj`` (transformers' in-memory layout) load to the
    same model as ``backbone.*`` with one tensor per expert; ``mtp.*`` tensors are skipped."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    renamed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        name = name.replace("backbone.", "model.", 1)
        if ".experts." in name:
            head, rest = name.split(".experts.")
            expert, proj = rest.split(".")[:2]
            key = f"{head}.experts.{proj}"
            renamed.setdefault(key, [None] * ours.config.num_experts)[int(expert)] = t
        else:
            renamed[name] = t
    stacked = {k: torch.stack(v) if isinstance(v, list) else v for k, v in renamed.items()}
    stacked["mtp.layers.0.norm.weight"] = torch.ones(4)
    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    save_file(stacked, str(out / "model.safetensors"))
    other = load_model(str(out), torch.float32, torch.device("cpu"))
    mine, theirs = ours.state_dict(), other.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


# ---------------------------------------------------------------------------- the whole engine


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([3, 65, 90, 130], seed=5)


@pytest.fixture(scope="module")
def expected(oracle, prompts) -> list[list[int]]:
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("max_num_batched_tokens", [16, 48], ids=["chunk16", "chunk48"])
def test_greedy_matches_hf_through_the_engine(model_dir, prompts, expected, max_num_batched_tokens) -> None:
    llm = LLM(
        str(model_dir),
        block_size=16,
        max_num_seqs=4,
        enable_prefix_caching=True,
        max_num_batched_tokens=max_num_batched_tokens,
        state_snapshot_interval=32,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):  # the second resumes from cached prefixes and state snapshots
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.outputs[0].token_ids == ref, f"run {run}, prompt {i} ({len(prompts[i])} tokens)"
        if run == 1:
            assert sum(o.num_cached_tokens for o in outs) > 0


def test_seeded_n_is_the_same_with_async_scheduling_on_and_off(model_dir, prompts) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=11, max_tokens=10, ignore_eos=True)
    runs = []
    for kw in (dict(async_scheduling="off"), dict(async_scheduling="on", max_num_batched_tokens=16)):
        llm = LLM(str(model_dir), block_size=16, **kw)
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
    assert runs[0] == runs[1]
    assert any(len({tuple(t) for t in seqs}) > 1 for seqs in runs[0])  # the n samples differ
