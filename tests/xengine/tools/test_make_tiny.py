"""Generated checkpoints: sizes, files, tokenizer, and greedy output that is not degenerate."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from xengine.tools.make_tiny import ARCHS, build_config, count_params, default_model_dir, main


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_param_count(arch: str) -> None:
    assert 1_000_000 <= count_params(build_config(arch, "tiny")) <= 2_000_000


@pytest.mark.parametrize("arch", ARCHS)
def test_small_param_count_without_weights(arch: str) -> None:
    config = build_config(arch, "small")
    assert config.get_text_config().vocab_size == 32000  # a VL config nests its language model's
    assert 50_000_000 <= count_params(config) <= 60_000_000


def test_tiny_checkpoint_files(tiny_qwen3) -> None:
    names = {p.name for p in tiny_qwen3.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith(".bin") for n in names)
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    gen = json.loads((tiny_qwen3 / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert config["eos_token_id"] == im_end
    assert sorted(gen["eos_token_id"]) == sorted([im_end, eot])
    assert config["vocab_size"] == len(tok)
    assert config["dtype"] == "float32"
    assert tok.pad_token == "<|endoftext|>" and tok.bos_token is None


def test_llama_has_llama3_rope_scaling(make_model_dir) -> None:
    config = json.loads((make_model_dir("llama") / "config.json").read_text())
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    assert rope["rope_type"] == "llama3"
    assert config["tie_word_embeddings"] is False


def test_qwen2_has_qkv_bias(make_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(make_model_dir("qwen2"))
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_same_seed_same_weights_other_seed_differs(make_model_dir, tmp_path) -> None:
    from safetensors.torch import load_file

    a = load_file(make_model_dir("qwen3", "tiny", 0) / "model.safetensors")
    assert main(["--arch", "qwen3", "--size", "tiny", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "b" / "tokenizer.json").read_text() == (
        make_model_dir("qwen3", "tiny", 0) / "tokenizer.json"
    ).read_text()
    c = load_file(make_model_dir("qwen3", "tiny", 1) / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_output_varies(make_model_dir, arch: str) -> None:
    path = make_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    outputs = []
    for prompt in ["Hello, how are you?", "The capital of France is", "def main():"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        assert len(set(new)) >= 4, f"greedy output degenerate: {new}"
        outputs.append(tuple(new))
    assert len(set(outputs)) == len(outputs)


def test_default_model_dir_respects_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "default-qwen3-small"


def test_ensure_default_model_reuses_finished_build(monkeypatch, tmp_path) -> None:
    from xengine.tools.make_tiny import ensure_default_model

    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    target = default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert ensure_default_model(progress=False) == target
    assert sorted(p.name for p in target.parent.iterdir()) == ["default-qwen3-small"]
