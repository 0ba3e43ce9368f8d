"""A random EAGLE head for a generated target, in the layouts the public checkpoints use (the loader's
docstring, ``xengine/models/eagle.py``, says what each holds):

- ``eagle``: EAGLE-1 (``LlamaForCausalLM``, one layer): ``fc.weight`` / ``fc.bias``, ``layers.0.*`` without
  ``input_layernorm``; the target's head (no ``lm_head.weight``);
- ``eagle3``: ``LlamaForCausalLMEagle3``: ``fc.weight`` (three target layers wide), ``midlayer.*`` (its
  attention twice the width), ``norm.weight``, ``lm_head.weight`` over ``draft_vocab_size`` ids of the
  target's, ``d2t`` / ``t2d``; ``eagle_config.eagle_aux_hidden_state_layer_ids``.

    python -m xengine.tools.eagle_checkpoint TARGET OUT [--method eagle3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any


def _layer(hf: dict[str, Any], seed: int) -> dict[str, Any]:
    """One HF-initialised Llama layer of the target's shapes, by its name inside the layer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim"), initializer_range=hf.get("initializer_range", 0.02),
    )  # fmt: skip
    torch.manual_seed(seed)
    state = LlamaForCausalLM(cfg).state_dict()
    prefix = "model.layers.0."
    return {k[len(prefix) :]: v.clone() for k, v in state.items() if k.startswith(prefix)}


def make_eagle_head(
    target: Path, out: Path, method: str = "eagle", seed: int = 0, aux_layers: list[int] | None = None,
    draft_vocab_size: int | None = None,
) -> Path:  # fmt: skip
    """Write a random ``method`` head for the target checkpoint ``target`` into ``out``."""
    import torch
    from safetensors.torch import save_file

    target, out = Path(target), Path(out)
    hf = json.loads((target / "config.json").read_text())
    size, vocab = hf["hidden_size"], hf["vocab_size"]
    std = hf.get("initializer_range", 0.02)
    gen = torch.Generator().manual_seed(seed + 7)
    layer = _layer(hf, seed)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
            "rope_scaling", "eos_token_id", "bos_token_id")  # fmt: skip
    config: dict[str, Any] = {k: hf[k] for k in keys if hf.get(k) is not None}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):  # per layer type
        config["rope_parameters"] = rope.get("full_attention") or next(
            v for v in rope.values() if isinstance(v, dict)
        )
    config.update(model_type="llama", num_hidden_layers=1, torch_dtype="float32", hidden_act="silu")
    weights: dict[str, Any] = {}
    if method == "eagle":
        config["architectures"] = ["LlamaForCausalLM"]
        weights.update({f"layers.0.{k}": v for k, v in layer.items() if not k.startswith("input_layernorm")})
        weights["fc.weight"] = std * torch.randn(size, 2 * size, generator=gen)
        weights["fc.bias"] = std * torch.randn(size, generator=gen)
    elif method == "eagle3":
        num_layers = hf["num_hidden_layers"]
        aux = aux_layers or [2, num_layers // 2, num_layers - 3]
        if len(set(aux)) < 3:  # a target of few layers: its first, middle and last
            aux = [0, num_layers // 2, num_layers - 1]
        draft_vocab = draft_vocab_size or vocab // 2
        config.update(
            architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
            eagle_config={"eagle_aux_hidden_state_layer_ids": aux},
        )  # fmt: skip
        for k, v in layer.items():
            if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):  # the attention reads twice the width
                v = torch.cat([v, std * torch.randn(v.shape, generator=gen)], dim=1)
            weights[f"midlayer.{k}"] = v
        weights["midlayer.hidden_norm.weight"] = 1 + 0.1 * torch.randn(size, generator=gen)
        weights["fc.weight"] = std * torch.randn(size, len(aux) * size, generator=gen)
        weights["norm.weight"] = 1 + 0.1 * torch.randn(size, generator=gen)
        weights["lm_head.weight"] = std * torch.randn(draft_vocab, size, generator=gen)
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        weights["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        weights["t2d"] = t2d
    else:
        raise ValueError(f"method must be eagle or eagle3, got {method!r}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), {"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="the target's HF folder (make_tiny's)")
    parser.add_argument("out")
    parser.add_argument("--method", choices=["eagle", "eagle3"], default="eagle")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"wrote {make_eagle_head(Path(args.target), Path(args.out), args.method, args.seed)}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
