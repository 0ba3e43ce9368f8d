"""Write a seeded random PEFT LoRA adapter for a model folder (tests, benchmarks, demos).

``python -m xengine.tools.make_lora MODEL OUT --rank 8 --targets q_proj,v_proj`` writes OUT/
``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT's ``save_pretrained`` does. B is
random (PEFT initialises it to zero, which would make the adapter a no-op), scaled so the adapter
visibly changes a tiny model's greedy tokens without drowning the base model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def make_lora(
    model_dir: str | Path,
    out: str | Path,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
    alpha: float | None = None,
    rslora: bool = False,
    scale: float = 0.05,
) -> Path:
    """A random LoRA adapter of ``rank`` on the ``targets`` projections of ``model_dir``'s model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        use_rslora=rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    out = Path(out)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xengine.tools.make_lora", description=__doc__)
    parser.add_argument("model", help="the base model's folder")
    parser.add_argument("out", help="where to write the adapter folder")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument(
        "--targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_lora(args.model, args.out, args.rank, tuple(args.targets.split(",")), args.seed)
    print(f"wrote a rank-{args.rank} LoRA adapter to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
