"""GPTQ, AWQ and compressed-tensors int4 checkpoints packed here, straight from each format's documented
layout (not with xllm's packer), load to the weights they stand for.

Layouts (AutoGPTQ / GPTQModel, AutoAWQ, compressed-tensors):
- GPTQ: ``qweight [in / 8, out]``, input row ``8 i + j`` in bits ``4 j`` of word row ``i``; ``qzeros
  [groups, out / 8]``, column ``8 c + j`` in bits ``4 j``; v1 stores zero - 1; ``scales [groups, out]``
  fp16; ``g_idx [in]``.
- AWQ GEMM: ``qweight [in, out / 8]`` and ``qzeros [groups, out / 8]``, slot ``j`` of word ``c`` holding
  column ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][j]``; zeros as they are; ``scales [groups, out]`` fp16.
- compressed-tensors pack-quantized: ``weight_packed [out, in / 8]``, signed values + 8, input
  ``8 c + j`` in bits ``4 j``; symmetric: no zero points; ``weight_scale [out, groups]``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.xengine.models.quant_formats.quant_helpers import canonical_layers, load_unpacked
from xengine.tools.quantize import quantized_layer_names

GROUP = 64
AWQ_SLOTS = [0, 2, 4, 6, 1, 3, 5, 7]


def _words(nibbles: list[torch.Tensor]) -> torch.Tensor:
    """int32 words from the eight 4-bit values of each (slot j: bits 4j), wrapping into the sign bit."""
    word = torch.zeros_like(nibbles[0], dtype=torch.int64)
    for j, nibble in enumerate(nibbles):
        word |= nibble.to(torch.int64) << (4 * j)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _gptq(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, v1: bool) -> dict[str, torch.Tensor]:
    qt, zt = q.t(), zero.t()  # [in, out], [groups, out]
    stored = (zt - 1) if v1 else zt
    return {
        "qweight": _words([qt[j::8, :] for j in range(8)]),
        "qzeros": _words([stored[:, j::8] for j in range(8)]),
        "scales": scale.t().half(),
        "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // GROUP,
    }


def _awq(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    qt, zt = q.t(), zero.t()
    return {
        "qweight": _words([qt[:, s::8] for s in AWQ_SLOTS]),
        "qzeros": _words([zt[:, s::8] for s in AWQ_SLOTS]),
        "scales": scale.t().half(),
    }


def _compressed_symmetric(
    q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor
) -> dict[str, torch.Tensor]:
    signed = q.to(torch.int64) - 8  # symmetric: the zero point is 0, i.e. 8 once unsigned
    return {
        "weight_packed": _words([signed[:, j::8] + 8 for j in range(8)]),
        "weight_scale": scale.half(),
        "weight_shape": torch.tensor(list(q.shape)),
    }


CONFIGS = {
    "gptq_v1": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
    "gptq_v1_sym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "GEMM"},
    "compressed_sym": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": GROUP,
                },
            }
        },
        "ignore": ["lm_head"],
    },
}


def _write(dense: Path, out: Path, kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A ``kind`` checkpoint of random codes, zeros and fp16 scales for every layer of ``dense``'s
    model; returns each layer's float32 weight ``(q - zero) * scale``."""
    shutil.copytree(dense, out)
    config = json.loads((out / "config.json").read_text())
    layers = set(quantized_layer_names(config))
    tensors, expected = {}, {}
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in load_file(str(dense / "model.safetensors")).items():
        layer = name.removesuffix(".weight")
        if layer not in layers or not name.endswith(".weight"):
            tensors[name] = tensor
            continue
        out_f, in_f = tensor.shape
        q = torch.randint(0, 16, (out_f, in_f), generator=gen)
        zero = torch.randint(1, 16, (out_f, in_f // GROUP), generator=gen)  # >= 1: v1 can store it
        if kind.endswith("sym"):
            zero = torch.full_like(zero, 8)
        scale = (torch.rand(out_f, in_f // GROUP, generator=gen) * 0.01 + 1e-3).half().float()
        expected[layer] = (q - zero.repeat_interleave(GROUP, 1)).float() * scale.repeat_interleave(GROUP, 1)
        if kind.startswith("gptq"):
            parts = _gptq(q, zero, scale, v1=True)
        elif kind == "awq":
            parts = _awq(q, zero, scale)
        else:
            parts = _compressed_symmetric(q, zero, scale)
        tensors |= {f"{layer}.{part}": t.contiguous() for part, t in parts.items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dict(config, quantization_config=CONFIGS[kind])))
    return expected


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_independently_packed_checkpoint_loads_its_weights(make_model_dir, tmp_path: Path, kind: str) -> None:
    dense = make_model_dir("qwen3")
    expected = _write(dense, tmp_path / kind, kind)
    loaded = canonical_layers(load_unpacked(tmp_path / kind))
    qkv = torch.cat([expected[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv"])
    assert torch.equal(loaded["model.layers.1.self_attn.qkv_proj"].dequantize(), qkv)
    gate_up = torch.cat([expected[f"model.layers.0.mlp.{p}_proj"] for p in ("gate", "up")])
    assert torch.equal(loaded["model.layers.0.mlp.gate_up_proj"].dequantize(), gate_up)
    for layer in ("model.layers.0.self_attn.o_proj", "model.layers.3.mlp.down_proj"):
        assert torch.equal(loaded[layer].dequantize(), expected[layer]), layer
    assert loaded["model.layers.0.mlp.down_proj"].group_size == GROUP
