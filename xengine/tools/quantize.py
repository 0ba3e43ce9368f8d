"""Write a W8A8 int8 checkpoint from a dense one (``xllm model quantize``), in the compressed-tensors
format that ``xengine/models/quantization.py`` loads (and vLLM too).

Every linear layer of the model but the LM head is rounded to int8 per output channel, symmetric,
round-to-nearest (``ops/cpu_kernels/linear_int8.quantize_rows``, the same rounding as
``--quantization w8a8`` on the fly, so both give the same tokens): ``<layer>.weight`` int8 and
``<layer>.weight_scale [out, 1]`` float32. Everything else is copied as it is; ``config.json`` gains the
``quantization_config``. Shards keep their file names (the index's weight map gains the scales).

    python -m xengine.tools.quantize --model DENSE_DIR --out W8A8_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ops.cpu_kernels.linear_int8 import quantize_rows
from xengine.layers.linear import Linear
from xengine.models.info import hf_architecture, read_hf_config
from xengine.models.loader import safetensors_files
from xengine.models.quantization import quantization_config
from xengine.models.quantized_weights import SCALE_SUFFIX, checkpoint_names
from xengine.models.registry import get_model_class

INDEX = "model.safetensors.index.json"


def quantized_layer_names(hf_config: dict) -> list[str]:
    """Checkpoint names of the linear layers a W8A8 checkpoint of this model stores in int8."""
    with torch.device("meta"):
        model = get_model_class(hf_architecture(hf_config)).from_hf_config(hf_config)
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not module.float_output:
            names += checkpoint_names(name, module)
    return names


def quantize_checkpoint(model_dir: str, out_dir: str, progress: bool = True) -> int:
    """Write the W8A8 checkpoint of ``model_dir`` into ``out_dir``; returns the layers quantized."""
    hf_config = read_hf_config(model_dir)
    if hf_config.get("quantization_config"):
        raise ValueError(f"{model_dir!r} is quantized already")
    layers = set(quantized_layer_names(hf_config))
    files = safetensors_files(model_dir)
    os.makedirs(out_dir, exist_ok=True)
    done, weight_map = 0, {}
    for i, path in enumerate(files):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                layer = name.removesuffix(".weight")
                if name.endswith(".weight") and layer in layers:
                    if ".experts." in name:
                        raise ValueError("MoE expert weights are not quantized yet; quantize a dense model")
                    q, scale = quantize_rows(tensor)
                    tensors[name], tensors[layer + SCALE_SUFFIX] = q, scale[:, None]
                    done += 1
                else:
                    tensors[name] = tensor.contiguous()
        save_file(tensors, os.path.join(out_dir, os.path.basename(path)), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, os.path.basename(path))
        if progress:
            print(f"[{i + 1}/{len(files)}] {os.path.basename(path)}: {done} layers so far", file=sys.stderr)
    _copy_rest(model_dir, out_dir, files, weight_map, hf_config)
    return done


def _copy_rest(model_dir: str, out_dir: str, files: list[str], weight_map: dict, hf_config: dict) -> None:
    """Tokenizer and other files as they are; config.json with the quantization; the shard index."""
    skip = {os.path.basename(f) for f in files} | {INDEX, "config.json"}
    for entry in os.listdir(model_dir):
        src = os.path.join(model_dir, entry)
        if entry not in skip and os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, entry))
    config = dict(hf_config, quantization_config=quantization_config(["lm_head"]))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.isfile(os.path.join(model_dir, INDEX)):
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Write a W8A8 int8 (compressed-tensors) checkpoint of a dense one."
    )
    p.add_argument("--model", required=True, help="dense HF model folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--scheme", choices=["w8a8"], default="w8a8", help="quantization scheme")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    args = p.parse_args(argv)
    try:
        count = quantize_checkpoint(args.model, args.out, progress=not args.quiet)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"wrote {args.out}: {count} linear layers in int8 (W8A8)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
