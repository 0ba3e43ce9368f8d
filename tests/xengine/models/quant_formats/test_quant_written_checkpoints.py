"""``xllm model quantize`` for every scheme and format: the checkpoint loads back to exactly the values
``--quantization`` makes on the fly from the dense model (the same ``ops/quant`` rounding, packed,
written, unpacked and stitched back into merged q|k|v and gate|up layers without a bit lost)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.xengine.models.quant_formats.quant_helpers import canonical_layers, dense_layers, load_unpacked
from xengine.models.quant_formats.rounding import quantize_weight
from xengine.tools.quantize import quantize_checkpoint

CASES = [
    ("w8a8", "compressed-tensors"),
    ("int8", "compressed-tensors"),
    ("fp8", "compressed-tensors"),
    ("int4", "compressed-tensors"),
    ("int4", "gptq"),
    ("int4", "awq"),
]
METHODS = {"compressed-tensors": "compressed-tensors", "gptq": "gptq", "awq": "awq"}


@pytest.mark.parametrize(("scheme", "fmt"), CASES)
def test_written_checkpoint_loads_the_on_the_fly_values(
    make_model_dir, tmp_path: Path, scheme: str, fmt: str
) -> None:
    dense_dir = make_model_dir("llama")  # untied LM head: it must stay dense
    out = tmp_path / f"{scheme}-{fmt}"
    count = quantize_checkpoint(str(dense_dir), str(out), progress=False, scheme=scheme, fmt=fmt)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == METHODS[fmt]

    loaded = canonical_layers(load_unpacked(out))
    dense = dense_layers(load_unpacked(dense_dir))
    assert count == 28 and set(loaded) == set(dense)  # 7 projections x 4 layers; 16 merged modules
    for name, weight in dense.items():
        expected = quantize_weight(scheme, weight)  # merged: the shards' rounding is per row, like this
        got = loaded[name]
        assert torch.equal(got.q.float(), expected.q.float()), name
        assert torch.equal(got.scale, expected.scale), name
        if scheme == "int4":
            assert torch.equal(got.zero, expected.zero), name
        assert torch.equal(got.dequantize(), expected.dequantize()), name


def test_the_cli_writes_the_format_asked_for(make_model_dir, tmp_path: Path) -> None:
    out = tmp_path / "awq"
    cmd = [sys.executable, "-m", "xservice", "model", "quantize", "--model", str(make_model_dir("qwen3"))]
    cmd += ["--out", str(out), "--scheme", "int4", "--format", "awq"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "28/28" in proc.stderr  # the progress bar counted every layer
    assert "28 linear layers in int4 (groups of 128), AWQ" in proc.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"]["version"] == "gemm"
    refused = subprocess.run(
        [*cmd[:-4], "--out", str(tmp_path / "x"), "--scheme", "fp8", "--format", "gptq"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "--format gptq holds int4 only" in refused.stderr
