"""Every scheme and format ``xllm model quantize`` writes runs in the engine as ``--quantization`` runs
the dense model: the packed layers hold the same dequantized weights, bit for bit, and greedy tokens
are the same (tiny Qwen3, float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ops.cpu_kernels.build import kernel_library, unavailable_reason
from tests.xengine.conftest import random_prompts
from xengine.api.messages import SamplingParams
from xengine.layers.linear import Linear
from xengine.llm import LLM
from xengine.models.loader import load_model
from xengine.tools.quantize import quantize_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CASES = [
    ("w8a8", "compressed-tensors"),
    ("int8", "compressed-tensors"),
    ("fp8", "compressed-tensors"),
    ("int4", "compressed-tensors"),
    ("int4", "gptq"),
    ("int4", "awq"),
]


def _packed_weights(model_dir: Path, quantization: str) -> dict[str, torch.Tensor]:
    model = load_model(str(model_dir), torch.float32, torch.device("cpu"), quantization)
    return {
        name: _dequantized(m._packed_owner)
        for name, m in model.named_modules()
        if isinstance(m, Linear) and not m.float_output
    }


def _dequantized(packed: object) -> torch.Tensor:
    """The float32 weight a packed quantized layer multiplies by."""
    return packed.dequantized_weight()  # type: ignore[attr-defined]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(("scheme", "fmt"), CASES)
def test_checkpoint_runs_as_the_on_the_fly_scheme(
    make_model_dir, tmp_path: Path, scheme: str, fmt: str
) -> None:
    if scheme == "w8a8" and kernel_library("panel_gemm_int8") is None:
        pytest.skip(f"w8a8 needs the int8 panel kernel: {unavailable_reason('panel_gemm_int8')}")
    dense = make_model_dir("qwen3")
    ckpt = tmp_path / f"{scheme}-{fmt}"
    quantize_checkpoint(str(dense), str(ckpt), progress=False, scheme=scheme, fmt=fmt)

    on_the_fly, loaded = _packed_weights(dense, scheme), _packed_weights(ckpt, "none")
    assert set(loaded) == set(on_the_fly)
    for name, weight in on_the_fly.items():
        assert torch.equal(loaded[name], weight), name

    prompts = random_prompts([5, 33, 12], seed=4)
    assert _tokens(LLM(str(ckpt)), prompts) == _tokens(LLM(str(dense), quantization=scheme), prompts)
