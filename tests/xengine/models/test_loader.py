"""Loader safety and formats: safetensors only, no remote code, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from xengine.models.loader import load_model
from xengine.models.qwen3 import Qwen3ForCausalLM

CPU = torch.device("cpu")


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_pickle_only_folder_is_refused(checkpoint, tmp_path: Path) -> None:
    folder = tmp_path / "bin-only"
    folder.mkdir()
    shutil.copy(checkpoint("qwen3") / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled, never opened")
    with pytest.raises(ValueError, match="convert them to safetensors"):
        load_model(str(folder), torch.float32, CPU)


def test_auto_map_is_ignored(checkpoint, tmp_path: Path) -> None:
    folder = _copy(
        checkpoint("qwen3"), tmp_path / "remote", auto_map={"AutoModelForCausalLM": "evil.EvilModel"}
    )
    marker = tmp_path / "evil-ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nEvilModel = None\n")
    model = load_model(str(folder), torch.float32, CPU)
    assert type(model) is Qwen3ForCausalLM
    assert not marker.exists()


def test_unsupported_architecture_lists_supported(checkpoint, tmp_path: Path) -> None:
    folder = _copy(checkpoint("qwen3"), tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(folder), torch.float32, CPU)


def test_missing_config_and_weights(tmp_path: Path, checkpoint) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path), torch.float32, CPU)
    folder = tmp_path / "no-weights"
    folder.mkdir()
    shutil.copy(checkpoint("qwen3") / "config.json", folder / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(folder), torch.float32, CPU)


def test_sharded_checkpoint_loads_like_single_file(checkpoint, tmp_path: Path) -> None:
    single = checkpoint("llama")
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    sharded_model, single_model = (
        load_model(str(tmp_path), torch.float32, CPU),
        load_model(str(single), torch.float32, CPU),
    )
    for (name, a), (_, b) in zip(sharded_model.state_dict().items(), single_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_loaded_model_is_eval_without_grad_and_tied(checkpoint) -> None:
    model = load_model(str(checkpoint("qwen2")), torch.bfloat16, CPU)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie_word_embeddings
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_float32_linear_weights_are_input_major_with_checkpoint_values(checkpoint, variant: str) -> None:
    path = checkpoint(variant)
    model = load_model(str(path), torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    down = model.model.layers[0].mlp.down_proj.weight
    assert down.stride() == (1, down.shape[0])
    assert torch.equal(down, hf.model.layers[0].mlp.down_proj.weight)
    # A head tied to the embedding keeps the row-major layout its row lookups want.
    head = model.lm_head.weight
    tied = head is model.model.embed_tokens.weight
    assert head.is_contiguous() == tied
    assert torch.equal(head, hf.lm_head.weight)


def test_missing_and_unexpected_weights_are_errors(checkpoint) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint("qwen3") / "model.safetensors"))
    model = Qwen3ForCausalLM.from_hf_config(json.loads((checkpoint("qwen3") / "config.json").read_text()))
    partial = {k: v for k, v in weights.items() if "k_proj" not in k}
    with pytest.raises(ValueError, match="missing .*qkv_proj"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        model.load_weights([*weights.items(), ("model.extra.weight", torch.zeros(1))])
