"""Write a quantized checkpoint from a dense one (``xllm model quantize``), in a format the loader
(``xengine/models/quantization.py``) reads as it is, and vLLM and transformers too.

Every linear layer of the model but the LM head is rounded with the very functions ``--quantization``
uses at load (``xengine/models/quant_formats/rounding.py``), so the checkpoint and the dense model
quantized on the fly hold the same values and give the same tokens:

- ``w8a8``: compressed-tensors int-quantized (int8 weights per channel, int8 activations per token);
- ``int8``: compressed-tensors pack-quantized W8A16 (int8 weights per channel, weight-only);
- ``int4``: groups of 128, asymmetric, as compressed-tensors pack-quantized (default), GPTQ (v2 zero
  points) or AWQ (GEMM); scales stay float32 so they load back exactly;
- ``fp8``: compressed-tensors float-quantized FP8_DYNAMIC (e4m3 weights per channel).

Everything else is copied as it is; ``config.json`` gains the ``quantization_config``. Shards keep their
file names (the index's weight map is rewritten).

    python -m xengine.tools.quantize --model DENSE_DIR --out OUT_DIR [--scheme int4 --format gptq]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from xengine.models.info import hf_architecture, read_hf_config
from xengine.models.loader import safetensors_files
from xengine.models.quant_formats import awq, compressed, gptq
from xengine.models.quant_formats.canonical import SCHEMES, QuantizedWeight
from xengine.models.quant_formats.rounding import quantize_weight
from xengine.models.quantized_weights import checkpoint_names, quantizable_linears
from xengine.models.registry import get_model_class

INDEX = "model.safetensors.index.json"
FORMATS = ("compressed-tensors", "gptq", "awq")
DESCRIPTIONS = {
    "w8a8": "int8 (W8A8)",
    "int8": "int8 (weight-only)",
    "int4": "int4 (groups of {group})",
    "fp8": "fp8 e4m3 (FP8_DYNAMIC)",
}


def quantized_layer_names(hf_config: dict) -> list[str]:
    """Checkpoint names of the linear layers a quantized checkpoint of this model stores quantized."""
    with torch.device("meta"):
        model = get_model_class(hf_architecture(hf_config)).from_hf_config(hf_config)
    return [n for name, module in quantizable_linears(model) for n in checkpoint_names(name, module)]


def check_choice(scheme: str, fmt: str) -> None:
    """``ValueError`` unless ``fmt`` can hold ``scheme`` (GPTQ and AWQ are int4 formats)."""
    if scheme not in SCHEMES:
        raise ValueError(f"--scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "compressed-tensors" and scheme != "int4":
        raise ValueError(f"--format {fmt} holds int4 only; {scheme} is written as compressed-tensors")


def quantize_checkpoint(
    model_dir: str,
    out_dir: str,
    progress: bool = True,
    scheme: str = "w8a8",
    fmt: str = "compressed-tensors",
) -> int:
    """Write the ``scheme`` checkpoint of ``model_dir`` in format ``fmt`` into ``out_dir``; returns the
    number of layers quantized."""
    from tqdm import tqdm

    check_choice(scheme, fmt)
    hf_config = read_hf_config(model_dir)
    if hf_config.get("quantization_config"):
        raise ValueError(f"{model_dir!r} is quantized already")
    layers = set(quantized_layer_names(hf_config))
    files = safetensors_files(model_dir)
    os.makedirs(out_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    group_sizes: set[int] = set()
    done = 0
    bar = tqdm(
        total=len(layers), desc=f"quantize {scheme}", unit="layer", file=sys.stderr, disable=not progress
    )
    for path in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                layer = name.removesuffix(".weight")
                if not (name.endswith(".weight") and layer in layers):
                    tensors[name] = tensor.contiguous()
                    continue
                if ".experts." in name:
                    raise ValueError("MoE expert weights are not quantized yet; quantize a dense model")
                quantized = quantize_weight(scheme, tensor)
                group_sizes.add(quantized.group_size)
                tensors |= _pack(fmt, scheme, layer, quantized)
                done += 1
                bar.update()
        save_file(tensors, os.path.join(out_dir, os.path.basename(path)), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, os.path.basename(path))
    bar.close()
    config = _config(fmt, scheme, group_sizes)
    _copy_rest(model_dir, out_dir, files, weight_map, dict(hf_config, quantization_config=config))
    return done


def _pack(fmt: str, scheme: str, layer: str, quantized: QuantizedWeight) -> dict[str, torch.Tensor]:
    if fmt == "gptq":
        return gptq.pack_layer(layer, quantized)
    if fmt == "awq":
        return awq.pack_layer(layer, quantized)
    return compressed.pack_layer(layer, quantized, scheme)


def _config(fmt: str, scheme: str, group_sizes: set[int]) -> dict[str, Any]:
    if scheme != "int4":
        return compressed.write_config(scheme, -1, ["lm_head"])
    if len(group_sizes) > 1:
        raise ValueError(f"layers were rounded in different group sizes {sorted(group_sizes)}")
    group = group_sizes.pop() if group_sizes else 128
    if fmt == "gptq":
        return gptq.write_config(group)
    if fmt == "awq":
        return awq.write_config(group)
    return compressed.write_config("int4", group, ["lm_head"])


def _copy_rest(model_dir: str, out_dir: str, files: list[str], weight_map: dict, hf_config: dict) -> None:
    """Tokenizer and other files as they are; config.json with the quantization; the shard index."""
    skip = {os.path.basename(f) for f in files} | {INDEX, "config.json"}
    for entry in os.listdir(model_dir):
        src = os.path.join(model_dir, entry)
        if entry not in skip and os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, entry))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if os.path.isfile(os.path.join(model_dir, INDEX)):
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def describe(scheme: str, fmt: str, group_size: int = 128) -> str:
    """How the final message names what was written, e.g. "int4 (groups of 128), GPTQ"."""
    names = {"compressed-tensors": "compressed-tensors", "gptq": "GPTQ", "awq": "AWQ"}
    return f"{DESCRIPTIONS[scheme].format(group=group_size)}, {names[fmt]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write a quantized checkpoint of a dense one.")
    p.add_argument("--model", required=True, help="dense HF model folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--scheme", choices=SCHEMES, default="w8a8", help="quantization scheme")
    p.add_argument("--format", choices=FORMATS, default="compressed-tensors", help="checkpoint format")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    args = p.parse_args(argv)
    try:
        count = quantize_checkpoint(args.model, args.out, not args.quiet, args.scheme, args.format)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(
            f"wrote {args.out}: {count} linear layers in {describe(args.scheme, args.format)}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
