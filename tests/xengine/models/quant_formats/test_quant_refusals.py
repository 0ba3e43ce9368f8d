"""Quantized checkpoints xllm cannot run exactly are refused with the config field or tensor that
differs, never loaded wrong: in Python a ``ValueError`` naming it, through ``xllm serve`` one clear
error line and exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.xengine.models.quant_formats.quant_helpers import load_unpacked
from xengine.tools.quantize import quantize_checkpoint

ROOT = Path(__file__).resolve().parents[4]


def _with_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization_config)))
    return dst


def _fp8_block(config: dict) -> dict:
    weights = config["config_groups"]["group_0"]["weights"]
    weights |= {"strategy": "block", "block_structure": [128, 128]}
    return config


CONFIG_REFUSALS = {
    "unknown method": ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    "gptq bits 3": ({"quant_method": "gptq", "bits": 3}, r"quantization_config.bits = 3 is not supported"),
    "awq gemv": (
        {"quant_method": "awq", "bits": 4, "version": "gemv"},
        r"quantization_config.version = 'gemv'",
    ),
    "deepseek fp8": (
        {"quant_method": "fp8", "weight_block_size": [128, 128]},
        r"quant_method 'fp8' \(block-wise FP8: weight_block_size\) is not supported",
    ),
    "gptq marlin": (
        {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
        "checkpoint_format = 'marlin'",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_unsupported_configs_are_refused_by_field(make_model_dir, tmp_path: Path, case: str) -> None:
    config, message = CONFIG_REFUSALS[case]
    bad = _with_config(make_model_dir("qwen3"), tmp_path / "bad", config)
    with pytest.raises(ValueError, match=message):
        load_unpacked(bad)


def test_block_fp8_and_activation_order_are_refused_by_name(make_model_dir, tmp_path: Path) -> None:
    dense = make_model_dir("qwen3")
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(str(dense), str(fp8), progress=False, scheme="fp8")
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    block = _with_config(fp8, tmp_path / "block", _fp8_block(config))
    with pytest.raises(ValueError, match=r"group_0.weights.strategy = 'block' is not supported"):
        load_unpacked(block)

    gptq = tmp_path / "gptq"
    quantize_checkpoint(str(dense), str(gptq), progress=False, scheme="int4", fmt="gptq")
    tensors = load_file(str(gptq / "model.safetensors"))
    g_idx = tensors["model.layers.2.mlp.down_proj.g_idx"]
    tensors["model.layers.2.mlp.down_proj.g_idx"] = g_idx.flip(0).contiguous()  # act-order permutation
    save_file(tensors, str(gptq / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj.g_idx: desc_act \(activation order\)"):
        load_unpacked(gptq)


def test_a_gptq_v1_zero_point_that_wrapped_is_refused(make_model_dir, tmp_path: Path) -> None:
    """v1 stores zero - 1: a zero point of 0 becomes 0xF and would read back as 16."""
    gptq = tmp_path / "gptq"
    quantize_checkpoint(str(make_model_dir("qwen3")), str(gptq), progress=False, scheme="int4", fmt="gptq")
    tensors = load_file(str(gptq / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.qzeros"][0, 0] |= 0xF  # the first layer read: a zero stored as -1
    save_file(tensors, str(gptq / "model.safetensors"))
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq"
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match="layers.0.mlp.down_proj.qzeros holds a zero point of 0 stored as -1"
    ):
        load_unpacked(gptq)


def test_quantized_tensors_for_a_float_layer_are_refused(make_model_dir, tmp_path: Path) -> None:
    ckpt = tmp_path / "int8"
    quantize_checkpoint(str(make_model_dir("llama")), str(ckpt), progress=False, scheme="int8")
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.int8)  # a quantized LM head
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="'lm_head.weight' is quantized, but xllm keeps 'lm_head' in float"):
        load_unpacked(ckpt)


def test_serve_reports_the_refusal_in_one_line(make_model_dir, tmp_path: Path) -> None:
    bad = _with_config(make_model_dir("qwen3"), tmp_path / "bad", {"quant_method": "gptq", "bits": 3})
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "xservice", "serve", "--model", str(bad), "--port", "0", "--no-watchdog"]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("xllm: error: the engine did not start")
    assert "quantization_config.bits = 3 is not supported; xllm loads 4-bit GPTQ" in last
