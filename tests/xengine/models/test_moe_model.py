"""Qwen3-MoE model: logits parity with HF ``transformers`` through paged attention, sparse-layer layout
(``decoder_sparse_step`` / ``mlp_only_layers``), and both checkpoint layouts of the expert weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.xengine.models.helpers import PagedKV
from xengine.layers.moe import SparseMoeBlock
from xengine.models.loader import load_model
from xengine.models.qwen3_moe import Qwen3MoeForCausalLM

CPU = torch.device("cpu")
ATOL_FP32 = 1e-4
# Qwen3-MoE: even layers dense by decoder_sparse_step, layer 3 by mlp_only_layers (sparse: 1 and 5),
# top-k probabilities not renormalised. DeepSeek-V3: no q LoRA, non-interleaved YaRN RoPE whose mscale
# changes the softmax scale, two dense layers, 2 groups (top-1 group), weights not renormalised.
_COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, initializer_range=0.2
)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
         "mscale_all_dim": 0.8, "rope_theta": 10000.0}  # fmt: skip
_VARIANTS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        moe_intermediate_size=16, num_experts=16, num_experts_per_tok=3, num_hidden_layers=6,
        num_key_value_heads=2, head_dim=16, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False,
    ), [False, True, False, False, False, True]),
    "deepseek_v3": ("DeepseekV3Config", dict(
        moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=3, num_hidden_layers=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=24, n_group=2, topk_group=1, n_shared_experts=2, first_k_dense_replace=2,
        routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False, rope_parameters=_YARN,
        max_position_embeddings=256,
    ), [False, False, True, True]),
}  # fmt: skip


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory ``arch -> folder`` of the variant checkpoint (random router biases for DeepSeek)."""
    import transformers

    cache: dict[str, Path] = {}

    def _get(arch: str) -> Path:
        if arch not in cache:
            cls_name, kw, _ = _VARIANTS[arch]
            out = tmp_path_factory.mktemp(f"{arch}-variant")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**_COMMON, **kw))
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0, 0.05)
            model.save_pretrained(out)
            cache[arch] = out
        return cache[arch]

    return _get


@pytest.fixture(scope="module")
def checkpoints(make_model_dir, variant_dir):
    """Factory ``(arch, which) -> folder``: the make-tiny checkpoint or the variant."""
    return lambda arch, which: make_model_dir(arch) if which == "tiny" else variant_dir(arch)


@pytest.fixture(scope="module")
def tiny_moe(make_model_dir) -> Path:
    return make_model_dir("qwen3_moe")


def _load(path: Path):
    ours = load_model(str(path), torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


@torch.no_grad()
def _step(model, kv: PagedKV, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
    """One step; ``chunks``: (seq_id, new tokens, position of the first). Logits per chunk."""
    meta = kv.step([c[0] for c in chunks], [len(c[1]) for c in chunks], [c[2] + len(c[1]) for c in chunks])
    ids = torch.tensor([t for c in chunks for t in c[1]])
    positions = torch.tensor([p for c in chunks for p in range(c[2], c[2] + len(c[1]))])
    return list(
        model.compute_logits(model(ids, positions, kv.caches, meta)).split([len(c[1]) for c in chunks])
    )


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert (ours - ref).abs().max().item() <= ATOL_FP32
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


CHECKPOINTS = [(a, w) for a in _VARIANTS for w in ("tiny", "variant")]


@pytest.mark.parametrize(("arch", "which"), CHECKPOINTS, ids=[f"{a}-{w}" for a, w in CHECKPOINTS])
def test_chunked_prefill_and_decode_logits_match_hf(checkpoints, arch: str, which: str) -> None:
    ours, hf = _load(checkpoints(arch, which))
    vocab = ours.config.vocab_size
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (19, 6, 12)]
    refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    kv = PagedKV(ours.config.num_layers, ours.config.num_kv_heads, ours.config.head_dim, torch.float32)
    first = _step(ours, kv, [(0, seqs[0][:8], 0), (1, seqs[1][:5], 0), (2, seqs[2], 0)])
    for out, ref in zip(first, [refs[0][:8], refs[1][:5], refs[2]]):
        _assert_close(out, ref)
    # a decode token of sequence 1 beside the rest of sequence 0's prompt, which reads the cached chunk
    second = _step(ours, kv, [(1, seqs[1][5:], 5), (0, seqs[0][8:], 8)])
    _assert_close(second[0], refs[1][5:])
    _assert_close(second[1], refs[0][8:])


@pytest.mark.parametrize("arch", list(_VARIANTS))
def test_sparse_layers_follow_hf(checkpoints, arch: str) -> None:
    for which in ("tiny", "variant"):
        ours, hf = _load(checkpoints(arch, which))
        ours_sparse = [hasattr(layer.mlp, "experts") for layer in ours.model.layers]
        hf_sparse = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
        assert ours_sparse == hf_sparse and any(ours_sparse) and not all(ours_sparse)
    assert ours_sparse == _VARIANTS[arch][2]
    config = json.loads((checkpoints(arch, "tiny") / "config.json").read_text())
    assert config["num_experts_per_tok"] == 4 and 16 <= ours.config.num_experts <= 64


def test_mla_caches_one_latent_head_and_skips_mtp_layers(make_model_dir, tmp_path: Path) -> None:
    from xengine.models.info import read_model_info

    tiny = make_model_dir("deepseek_v3")
    info = read_model_info(str(tiny))
    config = json.loads((tiny / "config.json").read_text())
    assert (info.num_kv_heads, info.head_dim) == (1, config["kv_lora_rank"] + config["qk_rope_head_dim"])
    full_heads = config["num_attention_heads"] * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    assert info.head_dim < full_heads
    # a checkpoint with a multi-token-prediction layer after the last one loads the same model
    folder = tmp_path / "with-mtp"
    shutil.copytree(tiny, folder)
    weights = load_file(str(folder / "model.safetensors"))
    mtp = f"model.layers.{config['num_hidden_layers']}"
    weights[f"{mtp}.eh_proj.weight"] = torch.zeros(4, 4)
    weights[f"{mtp}.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, str(folder / "model.safetensors"))
    a, b = load_model(str(folder), torch.float32, CPU), load_model(str(tiny), torch.float32, CPU)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_stacked_expert_checkpoint_loads_like_per_expert(tiny_moe: Path, tmp_path: Path) -> None:
    """HF's fused layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    weights = load_file(str(tiny_moe / "model.safetensors"))
    per_expert = Qwen3MoeForCausalLM.from_hf_config(json.loads((tiny_moe / "config.json").read_text()))
    stacked: dict[str, torch.Tensor] = {k: v for k, v in weights.items() if ".experts." not in k}
    for i, layer in enumerate(per_expert.model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        prefix, num = f"model.layers.{i}.mlp.experts", layer.mlp.experts.num_experts
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{prefix}.{e}.gate_proj.weight"], weights[f"{prefix}.{e}.up_proj.weight"]]) for e in range(num)]
        )  # fmt: skip
        stacked[f"{prefix}.down_proj"] = torch.stack(
            [weights[f"{prefix}.{e}.down_proj.weight"] for e in range(num)]
        )
    folder = tmp_path / "stacked"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_moe / name, folder / name)
    save_file(stacked, str(folder / "model.safetensors"))
    a, b = load_model(str(folder), torch.float32, CPU), load_model(str(tiny_moe), torch.float32, CPU)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_missing_or_out_of_range_expert_is_an_error(tiny_moe: Path) -> None:
    weights = load_file(str(tiny_moe / "model.safetensors"))
    model = Qwen3MoeForCausalLM.from_hf_config(json.loads((tiny_moe / "config.json").read_text()))
    partial = {k: v for k, v in weights.items() if k != "model.layers.2.mlp.experts.7.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 1 weights: model.layers.2.mlp.experts.gate_up_proj"):
        model.load_weights(partial.items())
    extra = weights["model.layers.2.mlp.experts.0.down_proj.weight"]
    with pytest.raises(ValueError, match="expert 32 out of range"):
        model.load_weights([*weights.items(), ("model.layers.2.mlp.experts.32.down_proj.weight", extra)])
    with pytest.raises(
        ValueError, match=r"unexpected weight 'model.layers.0.mlp.experts.0.down_proj.weight'"
    ):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.experts.0.down_proj.weight", extra)])
