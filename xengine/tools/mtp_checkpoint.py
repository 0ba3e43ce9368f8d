"""Random multi-token-prediction layers added to a generated checkpoint, in the checkpoint's own layout:
DeepSeek-V3's ``model.layers.{num_hidden_layers}.*`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` beside a MoE decoder layer; ``num_nextn_predict_layers``), Qwen3-Next's ``mtp.*``
(``fc``, ``pre_fc_norm_embedding`` / ``_hidden``, ``norm``, ``layers.0.*``; ``mtp_num_hidden_layers``) and
MiMo-V2-Flash's ``model.mtp.layers.0.*`` (``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm`` beside a
sliding-window layer with ``pre_mlp_layernorm`` and a dense MLP; ``num_nextn_predict_layers``).

``make_deepseek_with_mtp`` writes a DeepSeek-V3 of 61 dense layers with one: transformers runs MTP
(``generate(use_mtp=True)``) for DeepSeek-V3 only when the MTP layer is ``model.layers.61``.

    python -m xengine.tools.mtp_checkpoint SRC OUT [--layers N]   # SRC: make_tiny's deepseek_v3 / qwen3_next / mimo
    python -m xengine.tools.mtp_checkpoint --deepseek61 OUT [--layers N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

_KINDS = ("deepseek_v3", "qwen3_next", "mimo_v2_flash")


def _mtp_block_weights(config: Any, seed: int) -> dict[str, Any]:
    """One freshly initialised decoder layer of ``config``'s model, the MoE kind with full attention
    (HF's initialisation, seeded), by its name inside the layer."""
    import torch
    from transformers import AutoModelForCausalLM

    from xengine.tools.make_tiny import _randomise_router_biases

    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = 1
    if cfg.model_type == "deepseek_v3":
        cfg.first_k_dense_replace = 0
    elif cfg.model_type == "mimo_v2_flash":  # a sliding-window layer with a dense MLP
        cfg.layer_types = ["sliding_attention"]
        cfg.mlp_layer_types = ["dense"]
    else:
        cfg.layer_types = ["full_attention"]
        cfg.mlp_only_layers = []
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomise_router_biases(model, seed)
    if cfg.model_type == "qwen3_next":
        from xengine.tools.tiny_qwen3_next import randomise

        randomise(model, seed)
    state = model.state_dict()
    prefix = "model.layers.0."
    return {k[len(prefix) :]: v.clone() for k, v in state.items() if k.startswith(prefix)}


def add_mtp_layer(src: Path, out: Path, seed: int = 0, num_layers: int = 1) -> Path:
    """``src`` (a deepseek_v3, qwen3_next or mimo_v2_flash checkpoint) copied to ``out`` with
    ``num_layers`` random MTP layers (Qwen3-Next: its ``fc`` and norms shared by them)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    src, out = Path(src), Path(out)
    config = AutoConfig.from_pretrained(src)
    if config.model_type not in _KINDS:
        raise ValueError(f"MTP layers are written for {', '.join(_KINDS)}; {src} is {config.model_type}")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    weights = load_file(str(src / "model.safetensors"))
    blocks = [_mtp_block_weights(config, seed + 100 + 10 * i) for i in range(num_layers)]
    gen = torch.Generator().manual_seed(seed + 101)
    size, std = config.hidden_size, config.initializer_range
    centre = 0.0 if config.model_type == "qwen3_next" else 1.0  # Qwen3-Next's norms scale by 1 + weight

    def norm() -> Any:
        return centre + 0.1 * torch.randn(size, generator=gen)

    def proj() -> Any:
        return std * torch.randn(size, 2 * size, generator=gen)

    hf = json.loads((src / "config.json").read_text())
    for i, block in enumerate(blocks):
        if config.model_type == "deepseek_v3":
            layer = f"model.layers.{config.num_hidden_layers + i}."
            weights.update({layer + k: v for k, v in block.items()})
            weights[layer + "enorm.weight"], weights[layer + "hnorm.weight"] = norm(), norm()
            weights[layer + "shared_head.norm.weight"] = norm()
            weights[layer + "eh_proj.weight"] = proj()
            hf["num_nextn_predict_layers"] = num_layers
        elif config.model_type == "mimo_v2_flash":
            layer = f"model.mtp.layers.{i}."
            for k, v in block.items():
                k = k.replace("post_attention_layernorm.", "pre_mlp_layernorm.")
                k = k.replace("self_attn.sinks", "self_attn.attention_sink_bias")  # the release's names
                weights[layer + k] = v
            weights[layer + "enorm.weight"], weights[layer + "hnorm.weight"] = norm(), norm()
            weights[layer + "final_layernorm.weight"] = norm()
            weights[layer + "eh_proj.weight"] = proj()
            hf["num_nextn_predict_layers"] = num_layers
        else:
            weights.update({f"mtp.layers.{i}." + k: v for k, v in block.items()})
            hf["mtp_num_hidden_layers"] = num_layers
    if config.model_type == "qwen3_next":
        weights["mtp.pre_fc_norm_embedding.weight"] = norm()
        weights["mtp.pre_fc_norm_hidden.weight"] = norm()
        weights["mtp.norm.weight"] = norm()
        weights["mtp.fc.weight"] = proj()
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), {"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def make_deepseek_with_mtp(out: Path, num_layers: int = 61, seed: int = 0, num_mtp_layers: int = 1) -> Path:
    """A tiny DeepSeek-V3 of ``num_layers`` dense layers (make_tiny's shapes and tokenizer) with
    ``num_mtp_layers`` MTP layers (MoE) after them."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from xengine.tools.make_tiny import _save_quietly, make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny("deepseek_v3", "tiny", Path(tmp) / "base", seed=seed, progress=False)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(base)
        config.num_hidden_layers = num_layers
        config.first_k_dense_replace = num_layers
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 3)
        with torch.no_grad():  # norms that matter: the final norm is what the MTP layer reads
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.2 * torch.randn(p.shape, generator=gen))
        deep = Path(tmp) / "deep"
        _save_quietly(model, deep, quiet=True)
        for f in base.iterdir():  # tokenizer and generation config
            if f.is_file() and f.name not in ("config.json", "model.safetensors"):
                shutil.copy(f, deep / f.name)
        return add_mtp_layer(deep, Path(out), seed, num_mtp_layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "src", nargs="?", help="a make_tiny deepseek_v3 / qwen3_next / mimo_v2_flash checkpoint"
    )
    parser.add_argument("out")
    parser.add_argument("--deepseek61", action="store_true", help="write the 61-layer DeepSeek-V3 instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=1, help="MTP layers to write (default 1; MiMo ships 3)")
    args = parser.parse_args(argv)
    if args.deepseek61:
        path = make_deepseek_with_mtp(Path(args.out), seed=args.seed, num_mtp_layers=args.layers)
    elif args.src:
        path = add_mtp_layer(Path(args.src), Path(args.out), args.seed, args.layers)
    else:
        parser.error("give SRC, or --deepseek61")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
