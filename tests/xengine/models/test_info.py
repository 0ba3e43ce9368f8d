"""Torch-free model info from config.json / generation_config.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xengine.models import read_model_info, supported_architectures

ROOT = Path(__file__).resolve().parents[3]


def _write(folder: Path, config: dict, generation: dict | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return str(folder)


BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "max_position_embeddings": 512,
    "eos_token_id": 2,
    "dtype": "bfloat16",
}


def test_reads_fields_and_unions_eos(tmp_path: Path) -> None:
    info = read_model_info(_write(tmp_path, BASE, {"eos_token_id": [7, 2]}))
    assert info.architecture == "LlamaForCausalLM" and info.model_type == "llama"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (3, 8, 8, 8)
    assert info.eos_token_ids == [2, 7]
    assert info.torch_dtype == "bfloat16" and info.max_position_embeddings == 512
    assert info.tie_word_embeddings is False


def test_generated_checkpoint(checkpoint) -> None:
    info = read_model_info(str(checkpoint("qwen3")))
    assert (info.architecture, info.head_dim, info.num_kv_heads, info.vocab_size) == (
        "Qwen3ForCausalLM",
        16,
        2,
        512,
    )


@pytest.mark.parametrize(
    "change,match",
    [({"architectures": ["BertModel"]}, "unsupported model architecture 'BertModel'.*Qwen2ForCausalLM"),
     ({"architectures": None}, "architectures"),
     ({"vocab_size": None}, "vocab_size")],
)  # fmt: skip
def test_invalid_configs(tmp_path: Path, change: dict, match: str) -> None:
    config = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        read_model_info(_write(tmp_path, config))


def test_missing_folder_or_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_model_info(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        read_model_info(str(tmp_path))


def test_info_and_registry_do_not_import_torch() -> None:
    code = "import sys, xengine.models, xengine.models.info; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    assert "MistralForCausalLM" in supported_architectures()
