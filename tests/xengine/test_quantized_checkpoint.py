"""W8A8 checkpoints: ``xllm model quantize`` writes a compressed-tensors int8 checkpoint, the engine
loads it as it is (no flag), and it gives the tokens ``--quantization w8a8`` gives on the dense model
(the same rounding, made once on disk instead of at load). Schemes we do not run are refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

pytestmark = pytest.mark.skipif(
    kernel_library("panel_gemm_int8") is None,
    reason=f"int8 panel GEMM unavailable here: {unavailable_reason('panel_gemm_int8')}",
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _quantize(dense: Path, out: Path) -> Path:
    cmd = [sys.executable, "-m", "xservice", "model", "quantize", "--model", str(dense), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "linear layers in int8" in proc.stderr
    return out


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # tied and untied LM heads
def test_quantized_checkpoint_gives_the_on_the_fly_tokens(make_model_dir, tmp_path: Path, arch: str) -> None:
    dense = make_model_dir(arch)
    quantized = _quantize(dense, tmp_path / "w8a8")
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with safe_open(str(next(quantized.glob("*.safetensors"))), framework="pt") as f:
        names = set(f.keys())
        assert str(f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype) == "torch.int8"
        assert tuple(f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").shape)[1] == 1
    assert "lm_head.weight_scale" not in names
    prompts = random_prompts([5, 33, 12], seed=3)
    on_the_fly = _tokens(LLM(str(dense), quantization="w8a8"), prompts)
    assert _tokens(LLM(str(quantized)), prompts) == on_the_fly
    assert _tokens(LLM(str(quantized), dtype="bfloat16"), prompts)  # and runs in bf16


def _copy_with_config(src: Path, dst: Path, **quantization_config: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {**config.get("quantization_config", {}), **quantization_config}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_other_schemes_are_refused_by_name(make_model_dir, tmp_path: Path) -> None:
    dense = make_model_dir("qwen3")
    bnb = _copy_with_config(dense, tmp_path / "bnb", quant_method="bitsandbytes", load_in_4bit=True)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        LLM(str(bnb))
    quantized = _quantize(dense, tmp_path / "w8a8")
    groups = json.loads((quantized / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["input_activations"]["dynamic"] = False  # static activation scales
    static = _copy_with_config(quantized, tmp_path / "static", config_groups=groups)
    with pytest.raises(ValueError, match="input_activations.dynamic = False is not supported"):
        LLM(str(static))
    with pytest.raises(ValueError, match="quantized already"):
        _refuse_requantize(quantized, tmp_path)


def _refuse_requantize(quantized: Path, tmp_path: Path) -> None:
    from xengine.tools.quantize import quantize_checkpoint

    quantize_checkpoint(str(quantized), str(tmp_path / "again"), progress=False)


def test_a_dense_checkpoint_claiming_w8a8_is_refused(make_model_dir, tmp_path: Path) -> None:
    """Float weights under a W8A8 config (no scales, values not int8) must not load as if quantized."""
    from xengine.models.quantization import quantization_config

    fake = _copy_with_config(make_model_dir("qwen3"), tmp_path / "fake", **quantization_config(["lm_head"]))
    with pytest.raises(ValueError, match="missing"):
        LLM(str(fake))
